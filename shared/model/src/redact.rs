//! Secrets out of everything pitcrew keeps: command output, evidence, tool results and
//! timeline events are redacted before they are logged, published or stored. Values of
//! password/token/key assignments, Authorization headers, bearer tokens, credentials in URLs,
//! private key blocks and well-known token shapes become `[REDACTED]`.

use regex::{Regex, RegexSet};
use std::borrow::Cow;
use std::sync::{LazyLock, RwLock};

/// What replaces a secret.
pub const MARK: &str = "[REDACTED]";

/// What a command's placeholder for a secret opens with (`{secret:NAME}`): the policy gate
/// judges commands that hold one, the executor fills it in.
pub const PLACEHOLDER: &str = "{secret:";

struct Pattern {
    re: Regex,
    /// The replacement, with `$n` groups kept (the key, the separator).
    with: &'static str,
}

/// Word boundaries are ASCII ones, `(?-u:\b)`: the secrets and names the patterns look for
/// begin and end with ASCII characters, so such a boundary is found where a Unicode one is,
/// and also beside a non-ASCII letter (`éAKIA...` is redacted now). The one exception is
/// case folding's odd members: `(?i)s` also matches `ſ` (U+017F), and `ſecret=x` is no longer
/// redacted. A Unicode boundary would make the regex engine leave its DFA for
/// its slowest one on any text with a non-ASCII character (`systemctl status`'s `●` and `└─`,
/// an em dash in a message): 150 times slower (19 us against 0.12 for a 60-byte line).
static PATTERNS: LazyLock<Vec<Pattern>> = LazyLock::new(|| {
    let p = |re: &str, with: &'static str| Pattern { re: Regex::new(re).expect("redaction pattern"), with };
    vec![
        p(
            r"(?s)-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\z)",
            "[REDACTED PRIVATE KEY]",
        ),
        // The scheme and its space are kept with the name: a value redacted again (an incident
        // is validated by the gateway and again by intake) comes out the same, not longer.
        p(r"(?i)(?-u:\b)((?:proxy-)?authorization\s*:\s*(?:(?:basic|bearer|token|digest)\s+)?)\S+", "${1}[REDACTED]"),
        p(r"(?i)(?-u:\b)(bearer\s+)[A-Za-z0-9\-._~+/]+=*", "${1}[REDACTED]"),
        p(
            // `DB_PASSWORD=`, and the run-together names of clients' own variables
            // (`PGPASSWORD=`, `DBPASS=`), not any word ending in one (`NOPASSWD:`, `OLDPWD=`).
            r#"(?i)(?-u:\b)((?:[a-z0-9_-]*[_-]|pg|db|mysql|redis|mongo)?(?:password|passwd|pwd|pass|secret|token|api[_-]?key|apikey|access[_-]?key|private[_-]?key|credentials?)["']?\s*[:=]\s*["']?)[^\s"',;&]+"#,
            "${1}[REDACTED]",
        ),
        p(r"(?i)(--?(?:password|passwd|token|secret|api-key|apikey)\s+)\S+", "${1}[REDACTED]"),
        // `redis://:password@cache` has no user part at all.
        p(r"(?i)(?-u:\b)([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@", "${1}[REDACTED]@"),
        // A NATS URL's lone user part is its token (`nats://s3cret@nats:4222`).
        p(r"(?i)(?-u:\b)((?:nats|tls|wss?)://)[^/\s:@,]+@", "${1}[REDACTED]@"),
        // A header's value up to the line's end or a quote (a log line in JSON goes on).
        p(r#"(?i)(?-u:\b)((?:set-)?cookie\s*:\s*)[^\r\n"]+"#, "${1}[REDACTED]"),
        // A systemd unit's `Environment=` line (`systemctl cat`, a unit file, a drop-in) sets
        // variables whose names say nothing (`STRIPE_KEY=sk_live_...`): its whole value.
        p(r"(?m)^(\s*Environment\s*=\s*)[^\r\n]+", "${1}[REDACTED]"),
        // A kubeconfig's `client-key-data:` (a private key, base64).
        p(r"(?i)(?-u:\b)([a-z-]*key-data\s*:\s*)\S+", "${1}[REDACTED]"),
        p(r"(?-u:\b)AKIA[0-9A-Z]{16}(?-u:\b)", MARK),
        p(r"(?-u:\b)sk-[A-Za-z0-9_-]{16,}", MARK),
        p(r"(?-u:\b)xox[abprs]-[A-Za-z0-9-]{10,}", MARK),
        p(r"(?-u:\b)gh[pousr]_[A-Za-z0-9]{20,}", MARK),
        p(r"(?-u:\b)glpat-[A-Za-z0-9_-]{20,}", MARK),
        p(r"(?-u:\b)eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}", MARK),
    ]
});

/// Every pattern in one automaton: most text holds no secret, and one pass over it says so.
static ANY: LazyLock<RegexSet> =
    LazyLock::new(|| RegexSet::new(PATTERNS.iter().map(|p| p.re.as_str())).expect("redaction patterns"));

/// A name (a label's, a header's, a variable's) whose value is a secret whatever it looks like.
static SECRET_NAME: LazyLock<Regex> = LazyLock::new(|| {
    // The unmistakable words anywhere in the name; the short ones (`pass`, `pwd`, `token`,
    // `auth`) only as a part of their own (`db_pass`, `X-Auth-Token`), not `passthrough`.
    Regex::new(r"(?i)password|passwd|secret|credential|api[_-]?key|apikey|access[_-]?key|private[_-]?key|cookie|authorization|(?:^|[_.-])(?:pass|pwd|token|auth)(?:$|[_.-])")
        .expect("secret name pattern")
});

/// Whether a value named `name` is a secret by its name (`db_password`, `X-Api-Key`).
pub fn secret_name(name: &str) -> bool {
    SECRET_NAME.is_match(name)
}

/// The values of the secrets this process was given (its model key, chat tokens, database
/// and NATS passwords): redacted wherever they show, whatever they look like or are called
/// (`cat /proc/<pid>/environ`, a config file echoed back, an error quoting a URL).
static KNOWN: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// Values shorter than this are not registered: a short value (`admin`, the `postgres` of a
/// development DSN) would be redacted out of ordinary words, and a replacement is then never
/// longer than what it replaces (a text measured against a limit stays within it, whatever
/// secrets the process that measures it knows); the patterns still catch such a value where
/// it is named.
pub const MIN_KNOWN_LEN: usize = MARK.len();

/// Most values registered: the secrets of one process's configuration.
const MAX_KNOWN: usize = 64;

/// Of [`MAX_KNOWN`], the most the secrets commands name may take (see
/// [`register_command_secret`]): the rest stays free for the process's own credentials (its
/// NATS and Postgres passwords, the model's key, a chat bridge's tokens), which a process may
/// learn after its executors registered theirs.
pub const MAX_COMMAND_SECRETS: usize = MAX_KNOWN - 16;

/// Redact `value`, one of this process's secrets, wherever it shows from now on: when it is
/// at least [`MIN_KNOWN_LEN`] bytes long and not a plain word (letters only: `postgresql`
/// would be redacted out of every error that names the database). Says why not when it is
/// not (known already counts as kept): a short or plain value, or one past the [`MAX_KNOWN`]
/// this process keeps.
pub fn register_secret(value: &str) -> Result<(), NotKept> {
    register_within(value, MAX_KNOWN)
}

/// [`register_secret`] for the value of a secret commands name (`{secret:NAME}`): kept only
/// while fewer than [`MAX_COMMAND_SECRETS`] values are, so however many an operator gives a
/// worker, its own credentials are still redacted.
pub fn register_command_secret(value: &str) -> Result<(), NotKept> {
    register_within(value, MAX_COMMAND_SECRETS)
}

fn register_within(value: &str, room: usize) -> Result<(), NotKept> {
    let value = value.trim();
    if value.len() < MIN_KNOWN_LEN || value.chars().all(|c| c.is_alphabetic()) {
        return Err(NotKept::Plain);
    }
    let mut known = KNOWN.write().unwrap_or_else(|p| p.into_inner());
    if known.iter().any(|k| k == value) {
        return Ok(());
    }
    if known.len() >= room {
        return Err(NotKept::Full);
    }
    known.push(value.to_string());
    // Longest first: a secret that holds another is replaced whole, not around it.
    known.sort_by_key(|k| std::cmp::Reverse(k.len()));
    Ok(())
}

/// Stop redacting `value` (a secret's earlier value, replaced by a new one): room for others.
pub fn forget_secret(value: &str) {
    KNOWN.write().unwrap_or_else(|p| p.into_inner()).retain(|k| k != value.trim());
}

/// Why a secret is not redacted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotKept {
    #[error(
        "too short or plain to be redacted from what pitcrew keeps (under {MIN_KNOWN_LEN} bytes, or letters only)"
    )]
    Plain,
    #[error(
        "one secret too many: this process redacts at most {MAX_KNOWN} values, of which secrets commands name \
         may take {MAX_COMMAND_SECRETS}"
    )]
    Full,
}

/// The shortest start of a known secret replaced where a text ends with it.
const MIN_PARTIAL: usize = 4;

/// Where the start of a known secret begins, when `body` ends with one: a text cut short at
/// a cap (a command's output read up to its limit, a line clipped) may stop partway through a
/// secret, whose start the replacement of whole values passes over. The longest such start.
fn cut_secret_at(body: &str, known: &[String]) -> Option<usize> {
    let mut from: Option<usize> = None;
    for k in known {
        let Some(head) = k.get(..MIN_PARTIAL) else { continue };
        // Only where a start shorter than the whole secret may begin.
        let mut window = body.len().saturating_sub(k.len() - 1);
        while !body.is_char_boundary(window) {
            window += 1;
        }
        for (at, _) in body[window..].match_indices(head) {
            let at = window + at;
            if k.as_bytes().starts_with(&body.as_bytes()[at..]) {
                from = Some(from.map_or(at, |f| f.min(at)));
                break;
            }
        }
    }
    from
}

/// A text cut short at a cap (`trim`'s cuts, a command's output read up to its limit): the
/// start of a known secret it ends with replaced (whole values are [`redact`]'s). Only where a
/// cut was made: a text that merely ends like a secret's first letters (`local` of a
/// `local-crew` password) is left alone elsewhere.
pub fn redact_cut(text: &str) -> Cow<'_, str> {
    let known = KNOWN.read().unwrap_or_else(|p| p.into_inner());
    match cut_secret_at(text, &known) {
        Some(at) => Cow::Owned(format!("{}{MARK}", &text[..at])),
        None => Cow::Borrowed(text),
    }
}

/// `url` with the userinfo part (everything before `@` in the authority) replaced by `***`, for
/// errors and logs that name an endpoint.
pub fn url_shown(url: &str) -> String {
    // Without a scheme (`ops:pw@proxy:8080/v1`), whatever precedes an `@` may be a password.
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.rfind('@').map_or_else(|| url.to_string(), |at| format!("***{}", &url[at..]));
    };
    let authority_end = url[scheme_end..].find(['/', '?', '#']).map_or(url.len(), |i| scheme_end + i);
    match url[scheme_end..authority_end].rfind('@') {
        Some(at) => format!("{}***{}", &url[..scheme_end], &url[scheme_end + at..]),
        None => url.to_string(),
    }
}

/// `text` with every secret it shows replaced.
pub fn redact(text: &str) -> Cow<'_, str> {
    let known = KNOWN.read().unwrap_or_else(|p| p.into_inner());
    let shows_known = known.iter().any(|k| text.contains(k.as_str()));
    if !shows_known && !ANY.is_match(text) {
        return Cow::Borrowed(text);
    }
    let mut out = Cow::Borrowed(text);
    if shows_known {
        for k in known.iter() {
            if out.contains(k.as_str()) {
                out = Cow::Owned(out.replace(k.as_str(), MARK));
            }
        }
    }
    drop(known);
    for p in PATTERNS.iter() {
        if p.re.is_match(&out) {
            out = Cow::Owned(p.re.replace_all(&out, p.with).into_owned());
        }
    }
    out
}

/// Command output as pitcrew keeps it: secrets redacted, then trimmed to `max` bytes (head
/// plus error-looking lines).
pub fn kept(text: &str, max: usize) -> String {
    crate::trim::trim_output(&redact(text), max)
}

/// Redact every string inside a JSON value, in place.
pub fn redact_json(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => {
            if let Cow::Owned(r) = redact(s) {
                *s = r;
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(redact_json),
        serde_json::Value::Object(map) => map.values_mut().for_each(redact_json),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests that register secrets one at a time: the registry is the process's.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[test]
    fn secrets_are_replaced_and_the_rest_kept() {
        let cases = [
            ("db password=hunter2 ok", "db password=[REDACTED] ok"),
            ("DB_PASSWORD: \"s3cr3t\"", "DB_PASSWORD: \"[REDACTED]\""),
            ("api_key=abcd1234&x=1", "api_key=[REDACTED]&x=1"),
            ("Authorization: Bearer eyJabc.def", "Authorization: Bearer [REDACTED]"),
            ("authorization: abc123", "authorization: [REDACTED]"),
            ("curl -H 'Authorization: Basic dXNlcjpwYXNz'", "curl -H 'Authorization: Basic [REDACTED]"),
            ("postgres://app:pa55w0rd@db:5432/app", "postgres://app:[REDACTED]@db:5432/app"),
            ("key AKIAIOSFODNN7EXAMPLE used", "key [REDACTED] used"),
            ("OPENAI sk-proj-abcdefghijklmnop1234", "OPENAI [REDACTED]"),
            ("slack xoxb-123456789012-abcdefghij", "slack [REDACTED]"),
            ("mysqladmin --password s3cret status", "mysqladmin --password [REDACTED] status"),
            ("PGPASSWORD=hunter2 psql", "PGPASSWORD=[REDACTED] psql"),
            ("DBPASS=x", "DBPASS=[REDACTED]"),
            // Beside non-ASCII text (a unit's status line, an accented word).
            ("● db.service — PGPASSWORD=hunter2 └─", "● db.service — PGPASSWORD=[REDACTED] └─"),
            ("clé AKIAIOSFODNN7EXAMPLEé", "clé [REDACTED]é"),
            ("éAuthorization: Bearer abc", "éAuthorization: Bearer [REDACTED]"),
            ("redis://:hunter2@cache:6379", "redis://:[REDACTED]@cache:6379"),
            ("nats://s3cret@nats:4222", "nats://[REDACTED]@nats:4222"),
            ("tls://a@n1:4222,tls://b@n2:4222", "tls://[REDACTED]@n1:4222,tls://[REDACTED]@n2:4222"),
            ("Cookie: session=abc; theme=dark", "Cookie: [REDACTED]"),
            (
                "[Service]\nEnvironment=STRIPE_KEY=sk_live_51abc LOG=1\nExecStart=/opt/web",
                "[Service]\nEnvironment=[REDACTED]\nExecStart=/opt/web",
            ),
            ("    client-key-data: LS0tLS1CRUdJTiBSU0Eg", "    client-key-data: [REDACTED]"),
            (r#"{"h":"Cookie: s=1","next":2}"#, r#"{"h":"Cookie: [REDACTED]","next":2}"#),
            (
                "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----\nafter",
                "[REDACTED PRIVATE KEY]\nafter",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(redact(input), want, "{input}");
            // Redacted again (the gateway, then intake), the text is the same: not longer.
            assert_eq!(redact(want), want, "redacted twice: {input}");
        }
        for plain in [
            "connection refused",
            "passed: 3 tests",
            "token bucket full",
            "GET /health -> 503",
            "http://web:8080/x",
            "ssh://deploy@web-1",
            "(root) NOPASSWD: /bin/systemctl",
            "OLDPWD=/home/ops",
            "bypass=1",
            "EnvironmentFile=/etc/default/web",
            "certificate-authority-data-file: /etc/ca.crt",
        ] {
            assert!(matches!(redact(plain), Cow::Borrowed(_)), "{plain} is left alone");
        }
    }

    /// A secret this process was given is redacted by its value, whatever shows it: an
    /// environment dump names it nothing a pattern knows.
    #[test]
    fn a_registered_secret_is_redacted_wherever_it_shows() {
        let _serial = serial();
        let value = "hooks-T0-B1-9f8e7d6c5b4a";
        let text = format!("SLACK_HOOK={value}\0HOME=/root\0and again {value}.");
        assert!(redact(&text).contains(value), "not a secret until registered");
        assert_eq!(register_secret(value), Ok(()));
        assert_eq!(register_secret("short"), Err(NotKept::Plain));
        assert_eq!(redact(&text), "SLACK_HOOK=[REDACTED]\0HOME=/root\0and again [REDACTED].");
        assert!(
            matches!(redact("a short word"), Cow::Borrowed(_)),
            "values under {MIN_KNOWN_LEN} bytes are not registered"
        );
        assert_eq!(register_secret("postgresql"), Err(NotKept::Plain));
        assert!(matches!(redact("postgresql is down"), Cow::Borrowed(_)), "nor plain words");
        // One secret inside another: the longer is replaced whole.
        let _ = register_secret("abc-123-def");
        let _ = register_secret("abc-123-def-456-ghi");
        assert_eq!(redact("k=abc-123-def-456-ghi"), "k=[REDACTED]");
        // A value replaced by a new one is forgotten.
        forget_secret("abc-123-def-456-ghi");
        assert_eq!(redact("k=abc-123-def-456-ghi"), "k=[REDACTED]-456-ghi", "the other one stays");
    }

    /// However many secrets a worker's commands may name, room is left for the worker's own
    /// credentials, which it may learn after them (the monitor connects to NATS after it made
    /// its executors).
    #[test]
    fn secrets_commands_name_leave_room_for_the_process_own() {
        let _serial = serial();
        let mut kept = 0;
        for i in 0..MAX_KNOWN {
            match register_command_secret(&format!("command-secret-{i:03}-Zq")) {
                Ok(()) => kept += 1,
                Err(e) => assert_eq!(e, NotKept::Full),
            }
        }
        assert!(kept > 0 && kept <= MAX_COMMAND_SECRETS, "{kept} kept");
        assert_eq!(register_command_secret("command-secret-late-Zq"), Err(NotKept::Full));
        assert_eq!(register_command_secret("command-secret-000-Zq"), Ok(()), "one kept already stays kept");
        let own = "nats-password-after-them-7";
        assert_eq!(register_secret(own), Ok(()));
        assert_eq!(redact(&format!("auth failed for {own}")), "auth failed for [REDACTED]");
        for i in 0..MAX_KNOWN {
            forget_secret(&format!("command-secret-{i:03}-Zq"));
        }
        forget_secret(own);
    }

    /// Output read up to its cap, or a line clipped, can stop partway through a secret: where
    /// a cut was made, the start it shows is replaced too (from its first 4 bytes). Elsewhere
    /// a text that ends like a secret's first letters is left alone.
    #[test]
    fn a_secret_cut_short_at_the_end_of_a_text_is_redacted_too() {
        let _serial = serial();
        let value = "cut-short-Q7w9-secret";
        assert_eq!(register_secret(value), Ok(()));
        let echoed = "token echoed: cut-short-Q7w9-secret and more";
        assert_eq!(crate::trim::text_within(echoed.as_bytes(), 26), "token echoed: [REDACTED]");
        assert_eq!(crate::trim::clip(echoed, 26), "token echoed: [REDACTED]…");
        assert_eq!(redact_cut("whole then cut-sh"), "whole then [REDACTED]");
        for plain in ["ends in cut", "cut-shorter than that", "a text cut-short-Q7w"] {
            assert!(matches!(redact(plain), Cow::Borrowed(_)), "{plain}: not cut, left alone");
        }
        assert!(matches!(redact_cut("ends in cut"), Cow::Borrowed(_)), "under 4 bytes");
        assert_eq!(crate::trim::text_within(b"short enough", 26), "short enough");
        // Bytes under the cap whose text is not (each invalid byte is three bytes of U+FFFD):
        // cut all the same, the secret's start replaced.
        let latin1 = b"caf\xe9 \xe9t\xe9 cut-short-Q7w9-secret";
        assert!(latin1.len() < 33);
        assert_eq!(crate::trim::text_within(latin1, 33), "caf\u{FFFD} \u{FFFD}t\u{FFFD} [REDACTED]");
        forget_secret(value);
    }

    #[test]
    fn json_strings_are_redacted_in_place() {
        let mut v = serde_json::json!({ "output": "password=x1", "list": ["token: y2", 3], "n": 1 });
        redact_json(&mut v);
        assert_eq!(v, serde_json::json!({ "output": "password=[REDACTED]", "list": ["token: [REDACTED]", 3], "n": 1 }));
    }

    #[test]
    fn secret_names_are_known_by_their_words() {
        for name in ["db_password", "X-Api-Key", "auth_token", "DB_PASS", "client-secret", "pwd", "Authorization"] {
            assert!(secret_name(name), "{name}");
        }
        for name in ["passthrough", "tokenizer", "team", "author", "compass"] {
            assert!(!secret_name(name), "{name}");
        }
    }
}
