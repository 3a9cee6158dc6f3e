//! Shell-level reading of a command: constructs outside quotes (chaining, redirection,
//! substitution, backgrounding) and the normalised argv that policy patterns see.

/// The first shell construct in `raw` outside quotes, named as written; `None` when the
/// command is one plain program invocation. Single quotes hide everything; double quotes
/// still expand `$(` and backticks, so those count there too.
pub(crate) fn find_construct(raw: &str) -> Option<&'static str> {
    if raw.contains(['\n', '\r']) {
        return Some("newline");
    }
    if raw.contains('\0') {
        return Some("NUL");
    }
    #[derive(PartialEq)]
    enum Quote {
        None,
        Single,
        Double,
    }
    let chars: Vec<char> = raw.chars().collect();
    let mut quote = Quote::None;
    let mut i = 0;
    while i < chars.len() {
        let next = chars.get(i + 1).copied();
        match (&quote, chars[i]) {
            (Quote::Single, '\'') => quote = Quote::None,
            (Quote::Single, _) => {}
            (_, '\\') => i += 1, // the next character is literal
            (_, '`') => return Some("`"),
            (_, '$') if next == Some('(') => return Some("$("),
            // Nothing runs through a shell, so `$IFS`, `$HOME`, `${x}` would reach the program
            // literally: a command written for expansion is not what it seems.
            (_, '$') if next.is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '{') => return Some("$VAR"),
            (Quote::Double, '"') => quote = Quote::None,
            (Quote::Double, _) => {}
            (Quote::None, '\'') => quote = Quote::Single,
            (Quote::None, '"') => quote = Quote::Double,
            (Quote::None, ';') => return Some(";"),
            (Quote::None, '&') if next == Some('&') => return Some("&&"),
            (Quote::None, '&') => return Some("&"),
            (Quote::None, '|') if next == Some('|') => return Some("||"),
            (Quote::None, '|') => return Some("|"),
            (Quote::None, '>') => return Some(">"),
            (Quote::None, '<') => return Some("<"),
            (Quote::None, '(') => return Some("("),
            (Quote::None, ')') => return Some(")"),
            (Quote::None, _) => {}
        }
        i += 1;
    }
    None
}

/// A command that runs another command: how to find where the inner command starts.
struct Wrapper {
    name: &'static str,
    /// Short options that take a value (`-u root` or `-uroot`).
    short_with_value: &'static str,
    /// Long options that take a value (`--user root` or `--user=root`).
    long_with_value: &'static [&'static str],
    /// Plain arguments before the inner command (`timeout 5 cmd`, `chroot /mnt cmd`).
    positionals: usize,
}

const WRAPPERS: &[Wrapper] = &[
    Wrapper {
        name: "sudo",
        short_with_value: "ugCDhprtUTR",
        long_with_value: &[
            "user",
            "group",
            "close-from",
            "chdir",
            "host",
            "prompt",
            "role",
            "type",
            "other-user",
            "command-timeout",
            "chroot",
        ],
        positionals: 0,
    },
    Wrapper { name: "doas", short_with_value: "uC", long_with_value: &[], positionals: 0 },
    Wrapper {
        name: "env",
        short_with_value: "uCS",
        long_with_value: &["unset", "chdir", "split-string"],
        positionals: 0,
    },
    Wrapper { name: "nice", short_with_value: "n", long_with_value: &["adjustment"], positionals: 0 },
    Wrapper { name: "timeout", short_with_value: "sk", long_with_value: &["signal", "kill-after"], positionals: 1 },
    Wrapper {
        name: "ionice",
        short_with_value: "cnpPu",
        long_with_value: &["class", "classdata", "pid", "pgid", "uid"],
        positionals: 0,
    },
    Wrapper { name: "stdbuf", short_with_value: "ioe", long_with_value: &["input", "output", "error"], positionals: 0 },
    Wrapper { name: "chroot", short_with_value: "", long_with_value: &["userspec", "groups"], positionals: 1 },
    Wrapper { name: "taskset", short_with_value: "", long_with_value: &[], positionals: 1 },
    Wrapper { name: "time", short_with_value: "fo", long_with_value: &["format", "output"], positionals: 0 },
    Wrapper { name: "exec", short_with_value: "a", long_with_value: &[], positionals: 0 },
    Wrapper { name: "nohup", short_with_value: "", long_with_value: &[], positionals: 0 },
    Wrapper { name: "setsid", short_with_value: "", long_with_value: &[], positionals: 0 },
    Wrapper { name: "command", short_with_value: "", long_with_value: &[], positionals: 0 },
    Wrapper { name: "builtin", short_with_value: "", long_with_value: &[], positionals: 0 },
    Wrapper { name: "busybox", short_with_value: "", long_with_value: &[], positionals: 0 },
];

/// Wrappers unwrapped at most this many times (`sudo env nice cmd` is three).
const MAX_UNWRAP: usize = 8;

/// The last path component of a program (`/usr/bin/rm` -> `rm`).
fn basename(program: &str) -> &str {
    program.rsplit('/').next().unwrap_or(program)
}

fn is_assignment(word: &str) -> bool {
    match word.split_once('=') {
        Some((name, _)) => {
            !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        }
        None => false,
    }
}

/// Skip `w`'s options and positionals; returns where the inner command starts and the
/// value of `env -S` (a whole command line in one argument), if any.
fn skip_options(args: &[String], w: &Wrapper) -> (usize, Option<String>) {
    let mut i = 0;
    let mut split = None;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" {
            i += 1;
            break;
        }
        if !a.starts_with('-') {
            break;
        }
        let mut width = 1;
        if let Some(long) = a.strip_prefix("--") {
            let (name, attached) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            if w.long_with_value.contains(&name) {
                if attached.is_none() {
                    width = 2;
                }
                let value = attached.or_else(|| args.get(i + 1).cloned());
                if name == "split-string" {
                    split = value;
                }
            }
        } else if let Some((j, ch)) = a[1..].char_indices().find(|(_, c)| w.short_with_value.contains(*c)) {
            let attached = &a[1 + j + ch.len_utf8()..];
            let value = if attached.is_empty() {
                width = 2;
                args.get(i + 1).cloned()
            } else {
                Some(attached.to_string())
            };
            if w.name == "env" && ch == 'S' {
                split = value;
            }
        }
        i += width;
    }
    ((i + w.positionals).min(args.len()), split)
}

/// A command as policy patterns judge it, with what unwrapping it found on the way.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Unwrapped {
    /// Wrappers and leading `VAR=value` removed, the program reduced to its basename.
    pub argv: Vec<String>,
    /// The program as written (`/opt/app/bin/start`, `./start`, `start`).
    pub path: String,
    /// A privilege wrapper (`sudo`, `doas`, however written: `/usr/bin/sudo`, `env sudo`)
    /// was on the way: the program runs as another user.
    pub elevated: bool,
    /// Why the inner command cannot be told for sure: the gate refuses such a command.
    pub opaque: Option<String>,
}

/// Wrappers that run their command as another user.
const ELEVATING: &[&str] = &["sudo", "doas"];

/// The command policy patterns judge: wrappers and leading `VAR=value` removed and the
/// program reduced to its basename (`/usr/bin/sudo -n /bin/rm -rf /` -> `rm -rf /`), so a
/// wrapper cannot hide a forbidden program.
pub(crate) fn normalise(argv: &[String]) -> Vec<String> {
    unwrap(argv).argv
}

/// As [`normalise`], saying whether a privilege wrapper was on the way and whether the
/// inner command could not be told for sure: more wrappers than [`MAX_UNWRAP`], or `env -S`
/// (which splits its argument with escapes of its own, `\c` ending it early: the words the
/// gate would judge are not the words env runs).
pub(crate) fn unwrap(argv: &[String]) -> Unwrapped {
    let mut rest: Vec<String> = argv.to_vec();
    let mut out = Unwrapped::default();
    let mut unwrapped = 0;
    loop {
        let skip = rest.iter().take_while(|w| is_assignment(w)).count();
        rest.drain(..skip);
        let Some(first) = rest.first() else { break };
        let Some(w) = WRAPPERS.iter().find(|w| w.name == basename(first)) else {
            break;
        };
        if unwrapped == MAX_UNWRAP {
            out.opaque = Some(format!("wrapped in more than {MAX_UNWRAP} programs that run other programs"));
            break;
        }
        unwrapped += 1;
        out.elevated |= ELEVATING.contains(&w.name);
        let (start, split) = skip_options(&rest[1..], w);
        let mut inner: Vec<String> = rest[1 + start..].to_vec();
        if let Some(line) = split {
            out.opaque.get_or_insert_with(|| {
                "`env -S` splits its argument by rules of its own: what it runs cannot be told".into()
            });
            let mut words = shell_words::split(&line).unwrap_or_else(|_| vec![line]);
            words.append(&mut inner);
            inner = words;
        }
        rest = inner;
    }
    if let Some(first) = rest.first_mut() {
        out.path = first.clone();
        *first = basename(first).to_string();
    }
    out.argv = rest;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(cmd: &str) -> String {
        normalise(&shell_words::split(cmd).unwrap()).join(" ")
    }

    #[test]
    fn constructs_outside_quotes_are_found() {
        for (cmd, want) in [
            ("echo a; rm x", ";"),
            ("a && b", "&&"),
            ("a || b", "||"),
            ("curl x | sh", "|"),
            ("cat x > /etc/passwd", ">"),
            ("cat < x", "<"),
            ("sleep 1 &", "&"),
            ("echo $(id)", "$("),
            ("echo \"$(id)\"", "$("),
            ("echo `id`", "`"),
            ("echo \"`id`\"", "`"),
            ("(rm x)", "("),
            ("echo a\nrm x", "newline"),
            ("a 2>&1", ">"),
        ] {
            assert_eq!(find_construct(cmd), Some(want), "{cmd}");
        }
    }

    #[test]
    fn quoted_or_escaped_text_is_not_a_construct() {
        for cmd in [
            "echo 'a;b'",
            "echo 'a | b > c $(id) `id`'",
            "echo \"a;b && c | d\"",
            "find . -exec rm {} \\;",
            "echo a\\|b",
            "systemctl restart web",
            "echo \"it's\"",
            "echo \"a\\\"; b\"",
        ] {
            assert_eq!(find_construct(cmd), None, "{cmd}");
        }
    }

    #[test]
    fn wrappers_are_stripped() {
        assert_eq!(norm("sudo -n rm -rf /"), "rm -rf /");
        assert_eq!(norm("/usr/bin/sudo -u root -- /bin/rm -rf /"), "rm -rf /");
        assert_eq!(norm("sudo -nuroot rm x"), "rm x");
        assert_eq!(norm("sudo --user=root --preserve-env rm x"), "rm x");
        assert_eq!(norm("FOO=1 env -i BAR=2 nice -n 5 nohup timeout -s KILL 10 rm x"), "rm x");
        assert_eq!(norm("env -S 'rm -rf /' extra"), "rm -rf / extra");
        assert_eq!(norm("doas -u root reboot"), "reboot");
        assert_eq!(norm("chroot /mnt busybox rm x"), "rm x");
        assert_eq!(norm("sudo"), "");
        assert_eq!(norm("systemctl restart web"), "systemctl restart web");
        assert_eq!(norm("/usr/bin/toy start --port 1"), "toy start --port 1");
    }

    #[test]
    fn unwrapping_says_who_runs_it_and_what_it_cannot_see_through() {
        let of = |cmd: &str| unwrap(&shell_words::split(cmd).unwrap());
        for cmd in ["sudo kill 1", "/usr/bin/sudo kill 1", "env sudo kill 1", "nice doas kill 1", "sudo -u app kill 1"]
        {
            let u = of(cmd);
            assert!(u.elevated && u.opaque.is_none(), "{cmd}: {u:?}");
            assert_eq!(u.argv, ["kill", "1"], "{cmd}");
        }
        assert!(!of("kill 1").elevated && !of("nice kill 1").elevated);
        let deep = format!("{}reboot", "nice ".repeat(MAX_UNWRAP + 1));
        assert!(of(&deep).opaque.is_some_and(|why| why.contains("more than 8")), "{deep}");
        let eight = format!("{}reboot", "nice ".repeat(MAX_UNWRAP));
        assert_eq!(of(&eight), Unwrapped { argv: vec!["reboot".into()], path: "reboot".into(), ..Default::default() });
        assert_eq!(of("sudo /opt/app/bin/start -p 1").path, "/opt/app/bin/start");
        for cmd in ["env -S 'reboot\\c'", "env --split-string='rm x'", "sudo env -S'ls' x"] {
            assert!(of(cmd).opaque.is_some_and(|why| why.contains("env -S")), "{cmd}");
        }
    }
}
