//! Bounded text: command output and evidence are trimmed before they travel or are stored.

/// Keep at most `max` bytes of `text`: the head, then the lines that look like errors from the
/// rest, then a marker saying how much was dropped. Always cuts on a char boundary.
pub fn trim_output(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let head_budget = max / 2;
    let mut out = String::with_capacity(max + 64);
    let mut used = 0;
    let mut lines = text.lines();
    for line in lines.by_ref() {
        if used + line.len() + 1 > head_budget {
            break;
        }
        out.push_str(line);
        out.push('\n');
        used += line.len() + 1;
    }
    let mut dropped = 0usize;
    for line in lines {
        if looks_like_error(line) && used + line.len() < max.saturating_sub(48) {
            out.push_str(line);
            out.push('\n');
            used += line.len() + 1;
        } else {
            dropped += 1;
        }
    }
    if out.is_empty() {
        // One enormous line: cut it on a char boundary.
        let mut end = head_budget.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        out.push_str(&crate::redact::redact_cut(&text[..end]));
        out.push('\n');
    }
    out.push_str(&format!("[… {dropped} lines trimmed]"));
    out
}

/// A line worth keeping from the middle of a long output.
pub fn looks_like_error(line: &str) -> bool {
    let l = line.to_ascii_lowercase();
    [
        "error",
        "fail",
        "fatal",
        "panic",
        "denied",
        "refused",
        "timeout",
        "timed out",
        "cannot",
        "no such",
        "exception",
        "killed",
        "oom",
    ]
    .iter()
    .any(|k| l.contains(k))
}

/// `text` as Postgres can keep it: NUL, which neither `text` nor `jsonb` take (a command's
/// output, `cat /proc/1/cmdline` say, an HTTP body, a model's answer, a JSON incident's
/// `\u0000`), becomes U+FFFD. Without this, the write of the run holding it failed every time.
pub fn storable(text: String) -> String {
    if text.contains('\0') {
        text.replace('\0', "\u{FFFD}")
    } else {
        text
    }
}

/// Most bytes of an event's data as JSON. An event must fit one bus message (512 KiB) whatever
/// a publisher or a model put in it: one that does not is refused at every try, and the step
/// that emits it (a decision set aside, say) is retried for good.
pub const MAX_EVENT_DATA: usize = 128 * 1024;

/// `value` as an event keeps it: past [`MAX_EVENT_DATA`] bytes of JSON, an object saying how
/// large it was (`cut`), with the start of its text (`head`, at most half the limit before
/// the escaping of its quotes and backslashes, which at most doubles it).
pub fn bounded_json(value: &mut serde_json::Value) {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut size = Count(0);
    if serde_json::to_writer(&mut size, value).is_ok() && size.0 <= MAX_EVENT_DATA {
        return;
    }
    let head = clip(&value.to_string(), MAX_EVENT_DATA / 2);
    *value = serde_json::json!({
        "cut": format!("{} bytes of data, over the {MAX_EVENT_DATA} an event keeps", size.0),
        "head": head,
    });
}

/// `value` as Postgres can keep it: NUL in any string or key becomes U+FFFD (see [`storable`]).
pub fn storable_json(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::String(s) if s.contains('\0') => *s = s.replace('\0', "\u{FFFD}"),
        serde_json::Value::Array(items) => items.iter_mut().for_each(storable_json),
        serde_json::Value::Object(map) => {
            if map.keys().any(|k| k.contains('\0')) {
                *map = std::mem::take(map).into_iter().map(|(k, v)| (storable(k), v)).collect();
            }
            map.values_mut().for_each(storable_json);
        }
        _ => {}
    }
}

/// Bytes a process or a peer sent, as storable text: invalid UTF-8 and NUL become U+FFFD.
pub fn text_of(bytes: &[u8]) -> String {
    storable(String::from_utf8_lossy(bytes).into_owned())
}

/// As [`text_of`], and at most `max` bytes (cut on a char boundary, nothing appended): the
/// replacement character is three bytes, so a capped read stays capped.
pub fn text_within(bytes: &[u8], max: usize) -> String {
    let mut text = text_of(bytes);
    // Replacement characters may make the text longer than the bytes: cut here too.
    let cut_here = text.len() > max;
    if cut_here {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    // At its cap the text may have been cut (output is read up to it, or cut above): partway
    // through a secret, maybe, whose start whole-value redaction would pass over.
    if cut_here || bytes.len() >= max {
        if let std::borrow::Cow::Owned(cut) = crate::redact::redact_cut(&text) {
            return cut;
        }
    }
    text
}

/// Cut a string to at most `max` bytes on a char boundary (for one-line fields).
pub fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", crate::redact::redact_cut(&text[..end]))
}

/// Characters a terminal acts on or shows as nothing: C0 controls (newline and tab too), DEL,
/// C1 controls (0x9B is a one-character CSI), the line and paragraph separators, and the
/// zero-width, joiner and direction-changing format characters (see [`invisible`]).
pub fn unprintable(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') || invisible(c)
}

/// Zero-width, joiner, direction and other format characters that render as nothing.
pub fn invisible(c: char) -> bool {
    matches!(c as u32, 0x00AD | 0x180E | 0x200B..=0x200F | 0x202A..=0x202E | 0x2060..=0x2064 | 0x2066..=0x206F | 0xFEFF)
}

/// `text` as inert terminal text on one line: each [`unprintable`] character is shown escaped
/// (`\n`, `\t`, `\r`, else `\u{1b}`), everything else is kept as it is, quotes and backslashes
/// too. Text from alerts, hosts, models and deciders goes through it before the CLI prints it,
/// so an escape sequence in an alert cannot rewrite an operator's screen (hide a plan, retitle
/// the terminal, set its clipboard).
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(unprintable) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if unprintable(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Event data that would not fit a bus message is cut to a bounded object saying so;
    /// data within the limit is kept as it is.
    #[test]
    fn event_data_past_the_limit_is_cut_to_fit_a_message() {
        let mut small = serde_json::json!({"by": "ann", "output": "x".repeat(4096)});
        let kept = small.clone();
        bounded_json(&mut small);
        assert_eq!(small, kept);
        // Control characters take six bytes each as JSON, quotes two.
        for filler in ["\u{1}", "\""] {
            let mut big = serde_json::json!({"by": filler.repeat(200_000), "channel": "bot"});
            bounded_json(&mut big);
            let size = serde_json::to_vec(&big).unwrap().len();
            assert!(size <= MAX_EVENT_DATA + 1024, "{size} bytes");
            assert!(big["cut"].as_str().unwrap().contains("bytes of data"), "{big}");
            assert!(big["head"].as_str().unwrap().starts_with("{\"by\""), "{big}");
        }
    }

    #[test]
    fn printable_text_cannot_steer_a_terminal() {
        let hostile = "web\u{1b}]52;c;cm0=\u{7}\u{1b}[8m\r\nplan:\tfake\u{9b}2J\u{202e}\u{200b}\u{2028}\u{7f}";
        let shown = printable(hostile);
        assert!(!shown.chars().any(unprintable), "{shown}");
        assert_eq!(
            shown,
            "web\\u{1b}]52;c;cm0=\\u{7}\\u{1b}[8m\\r\\nplan:\\tfake\\u{9b}2J\\u{202e}\\u{200b}\\u{2028}\\u{7f}"
        );
        // Ordinary text, non-ASCII letters, quotes and backslashes are left alone (and not copied).
        let plain = r#"disk 98% on /var — ü "quoted" \d+ 'x'"#;
        assert!(matches!(printable(plain), std::borrow::Cow::Borrowed(t) if t == plain));
    }

    #[test]
    fn text_postgres_can_keep_within_its_cap() {
        assert_eq!(text_of(b"a\0b\xff"), "a\u{FFFD}b\u{FFFD}");
        assert_eq!(storable("clean".to_string()), "clean");
        assert_eq!(text_within(&[0; 4], 7), "\u{FFFD}\u{FFFD}", "cut on a char boundary, nothing appended");
        assert_eq!(text_within(b"abc", 2), "ab");
        let mut v = serde_json::json!({"a\0": ["x\0", {"k": "\0"}], "n": 1});
        storable_json(&mut v);
        assert_eq!(v, serde_json::json!({"a\u{FFFD}": ["x\u{FFFD}", {"k": "\u{FFFD}"}], "n": 1}));
    }

    #[test]
    fn short_text_is_untouched() {
        assert_eq!(trim_output("a\nb\n", 100), "a\nb\n");
    }

    #[test]
    fn long_text_keeps_head_and_errors_within_bound() {
        let mut text = String::new();
        for i in 0..1000 {
            text.push_str(&format!("line {i} ok\n"));
        }
        text.push_str("ERROR: disk full\n");
        for i in 0..1000 {
            text.push_str(&format!("tail {i}\n"));
        }
        let t = trim_output(&text, 1024);
        assert!(t.len() <= 1024 + 64, "{}", t.len());
        assert!(t.starts_with("line 0 ok\n"));
        assert!(t.contains("ERROR: disk full"));
        assert!(t.contains("lines trimmed"));
    }

    #[test]
    fn one_huge_line_is_cut_on_a_char_boundary() {
        let text = "é".repeat(5000);
        let t = trim_output(&text, 101);
        assert!(t.len() < 200);
        assert_eq!(clip("héllo", 2), "h…");
    }
}
