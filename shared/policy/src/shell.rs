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
        // `-a`/`--argv0` (coreutils 9.7): the next word is the program's name, not the program.
        short_with_value: "uCSa",
        long_with_value: &["unset", "chdir", "split-string", "argv0"],
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

/// `word` with its absolute path (the word, or what follows its first `=`: `of=/dev/sda`,
/// `--target=/etc`) spelled the shortest way: `//` and `/./` collapsed, `..` resolved
/// (`/tmp/../etc` -> `/etc`), as the kernel reads it but for symbolic links.
pub(crate) fn lexical_path(word: &str) -> std::borrow::Cow<'_, str> {
    let (head, path) = match word.find("=/") {
        Some(i) if !word.starts_with('/') => word.split_at(i + 1),
        _ => ("", word),
    };
    if !path.starts_with('/') || !(path.contains("//") || path.split('/').any(|p| p == "." || p == "..")) {
        return std::borrow::Cow::Borrowed(word);
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    let last = path.rsplit('/').next().unwrap_or("");
    let trailing = !parts.is_empty() && matches!(last, "" | "." | "..");
    let mut out = format!("{head}/{}", parts.join("/"));
    if trailing {
        out.push('/');
    }
    std::borrow::Cow::Owned(out)
}

/// Whether `word` (or what follows its first `=`) is a relative path that climbs above where
/// it starts (`../etc`, `a/../../x`): relative to a working directory the gate does not know.
pub(crate) fn climbs_above(word: &str) -> bool {
    let path = word.split_once('=').map_or(word, |(_, v)| v);
    if path.starts_with('/') || !path.split('/').any(|p| p == "..") {
        return false;
    }
    let mut depth = 0i32;
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    return true;
                }
            }
            _ => depth += 1,
        }
    }
    false
}

/// Wrappers unwrapped at most this many times (`sudo env nice cmd` is three).
const MAX_UNWRAP: usize = 8;

/// The last path component of a program (`/usr/bin/rm` -> `rm`).
fn basename(program: &str) -> &str {
    program.rsplit('/').next().unwrap_or(program)
}

/// A `NAME=value` word where `env` and `sudo` read one: any word holding `=` that is no
/// option (GNU env sets `a.b=1` too, and runs the word after it: a name the shell would not
/// take is still an assignment, never the program).
fn is_assignment(word: &str) -> bool {
    word.contains('=') && !word.starts_with('-')
}

/// Whether the variable `name` makes programs load or run code of its choosing: the dynamic
/// loader's (`LD_PRELOAD`), the shells' (`BASH_ENV`, `PS4`, exported functions), the editors,
/// pagers and helpers programs start (`EDITOR`: `crontab -e`, `systemctl edit`; `PAGER`,
/// `GIT_*`, `*_ASKPASS`), interpreters' start-up options and search paths, `PATH` itself.
pub(crate) fn runs_code(name: &str) -> bool {
    const NAMED: &[&str] = &[
        "BASH_ENV",
        "ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "PROMPT_COMMAND",
        "IFS",
        "PATH",
        "BROWSER",
        "LESSOPEN",
        "LESSCLOSE",
        "GCONV_PATH",
        "NODE_OPTIONS",
        "NODE_PATH",
        "PYTHONSTARTUP",
        "PYTHONPATH",
        "PYTHONHOME",
        "PERL5OPT",
        "PERL5LIB",
        "PERLLIB",
        "RUBYOPT",
        "RUBYLIB",
        "TAR_OPTIONS",
        "SSH_ASKPASS",
        "SUDO_ASKPASS",
    ];
    NAMED.contains(&name)
        || ["LD_", "GIT_", "BASH_FUNC_"].iter().any(|p| name.starts_with(p))
        || ["EDITOR", "VISUAL", "PAGER"].iter().any(|s| name.ends_with(s))
}

/// Wrapper options that keep a command read-only: they write nothing and touch no other
/// process (`time -o FILE` writes FILE, `ionice -p`/`taskset -p` change running processes,
/// `sudo -e` edits files, `setsid -f` leaves the command running). A wrapper missing here is
/// not read-only at all (`chroot`: it runs whatever program the new root holds). Long options
/// count only spelled out in full: a prefix's meaning depends on the wrapper's version.
const READ_ONLY_OPTIONS: &[(&str, &[&str])] = &[
    (
        "sudo",
        &["-n", "--non-interactive", "-u", "--user", "-g", "--group", "-H", "--set-home", "-P", "--preserve-groups"],
    ),
    ("doas", &["-n", "-u"]),
    ("env", &["-i", "--ignore-environment", "-u", "--unset"]),
    ("nice", &["-n", "--adjustment"]),
    ("timeout", &["-s", "--signal", "-k", "--kill-after", "--preserve-status", "--foreground", "-v", "--verbose"]),
    ("ionice", &["-c", "--class", "-n", "--classdata", "-t", "--ignore"]),
    ("stdbuf", &["-i", "--input", "-o", "--output", "-e", "--error"]),
    ("taskset", &["-c", "--cpu-list"]),
    ("time", &["-f", "--format", "-p", "--portability", "-v", "--verbose", "-q", "--quiet"]),
    ("exec", &[]),
    ("nohup", &[]),
    ("command", &[]),
    ("builtin", &[]),
    ("busybox", &[]),
];

/// Wrapper options that name a file the wrapper writes (`time -o FILE`, `--output=FILE`).
const OUTPUT_OPTIONS: &[(&str, &[&str])] = &[("time", &["-o", "--output"])];

/// Variables whose setting keeps a command read-only: `LD_PRELOAD=`, `PATH=`, `PAGER=` and
/// the like change what runs.
pub(crate) fn read_only_assignment(name: &str) -> bool {
    matches!(name, "LANG" | "LANGUAGE" | "TZ") || name.starts_with("LC_")
}

/// What [`skip_options`] read in a wrapper's arguments.
#[derive(Debug, Default)]
struct Skipped {
    /// Where the inner command starts.
    end: usize,
    /// Each option given, as `-x` or `--name` (as written: perhaps abbreviated).
    options: Vec<String>,
    /// Each option that takes a value, by its full name, with the value (`None` at the end).
    values: Vec<(String, Option<String>)>,
}

impl Skipped {
    /// The values given to any of `names`, in order.
    fn values_of<'a>(&'a self, names: &'a [&str]) -> impl Iterator<Item = String> + 'a {
        self.values.iter().filter(|(o, _)| names.contains(&o.as_str())).filter_map(|(_, v)| v.clone())
    }
}

/// One `--name[=value]`; true when its value is the next word. getopt takes any unambiguous
/// prefix (`--out` is `--output`, `--split` is `--split-string`), so a prefix of an option
/// that takes a value is read as that option.
fn long_option(long: &str, w: &Wrapper, next: Option<&String>, out: &mut Skipped) -> bool {
    let (name, attached) = match long.split_once('=') {
        Some((n, v)) => (n, Some(v.to_string())),
        None => (long, None),
    };
    out.options.push(format!("--{name}"));
    let with_value = &w.long_with_value;
    let Some(full) =
        with_value.iter().find(|o| **o == name).or_else(|| with_value.iter().find(|o| o.starts_with(name)))
    else {
        return false;
    };
    let next_word = attached.is_none();
    let value = attached.or_else(|| next.cloned());
    out.values.push((format!("--{full}"), value));
    next_word
}

/// One cluster of short options (`-nu root`, `-nuroot`); true when a value is the next word.
/// The first option that takes a value takes the rest of the word, or the next word.
fn short_options(cluster: &str, w: &Wrapper, next: Option<&String>, out: &mut Skipped) -> bool {
    for (j, ch) in cluster.char_indices() {
        out.options.push(format!("-{ch}"));
        if w.short_with_value.contains(ch) {
            let attached = &cluster[j + ch.len_utf8()..];
            let value = if attached.is_empty() { next.cloned() } else { Some(attached.to_string()) };
            out.values.push((format!("-{ch}"), value));
            return attached.is_empty();
        }
    }
    false
}

/// Read `w`'s options and skip its positionals: where the inner command starts, and what
/// options (and values) were given on the way.
fn skip_options(args: &[String], w: &Wrapper) -> Skipped {
    let mut out = Skipped::default();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" {
            i += 1;
            break;
        }
        if !a.starts_with('-') {
            break;
        }
        let next = args.get(i + 1);
        let took_next = match a.strip_prefix("--") {
            Some(long) => long_option(long, w, next, &mut out),
            None => short_options(&a[1..], w, next, &mut out),
        };
        i += 1 + usize::from(took_next);
    }
    out.end = (i + w.positionals).min(args.len());
    out
}

/// Why `w` with `options` is not read-only, if it is not.
fn not_read_only(w: &Wrapper, options: &[String]) -> Option<String> {
    let Some((_, allowed)) = READ_ONLY_OPTIONS.iter().find(|(name, _)| *name == w.name) else {
        return Some(format!("`{}` is not in the read-only class", w.name));
    };
    let bad = options.iter().find(|o| !allowed.contains(&o.as_str()))?;
    let admitted = if allowed.is_empty() { "none".to_string() } else { allowed.join(" ") };
    Some(format!("`{} {bad}` is not read-only (its read-only options: {admitted})", w.name))
}

/// A command as policy patterns judge it, with what unwrapping it found on the way.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Unwrapped {
    /// Wrappers and leading `VAR=value` removed, the program reduced to its basename.
    pub argv: Vec<String>,
    /// The program as written (`/opt/app/bin/start`, `./start`, `start`).
    pub path: String,
    /// Where the program stands among the command's words (None when `env -S` made words of
    /// its own).
    pub index: Option<usize>,
    /// A privilege wrapper (`sudo`, `doas`, however written: `/usr/bin/sudo`, `env sudo`)
    /// was on the way: the program runs as another user.
    pub elevated: bool,
    /// Why the inner command cannot be told for sure: the gate refuses such a command.
    pub opaque: Option<String>,
    /// Files a wrapper writes (`time -o FILE`): rules that look for writes judge them.
    pub writes: Vec<String>,
    /// Why the wrappers or `VAR=value` on the way are not read-only (`time -o`, `ionice -p`,
    /// `LD_PRELOAD=`): the read-only class refuses such a command.
    pub not_read_only: Option<String>,
    /// The names of the variables set on the way (`env EDITOR=x`, `sudo LD_PRELOAD=x`), in order.
    pub assignments: Vec<String>,
}

/// A program named bare (found on `PATH`) or by its path in a system directory. The
/// read-only class judges programs by name: `/srv/app/bin/test --reset-db` or `./service` is
/// not the `test` or `service` it knows.
fn is_system_program(word: &str) -> bool {
    match word.rsplit_once('/') {
        None => true,
        Some((dir, name)) => {
            ["/bin", "/sbin", "/usr/bin", "/usr/sbin"].contains(&dir) && !name.is_empty() && name != "." && name != ".."
        }
    }
}

/// Note in `out` that `program` is not read-only unless it is a system program (the first
/// reason found stands).
fn note_unless_system_program(out: &mut Unwrapped, program: &str) {
    if !is_system_program(program) && out.not_read_only.is_none() {
        out.not_read_only = Some(format!(
            "`{program}` is not a system program: the read-only class runs programs by name or from /bin, /sbin, \
             /usr/bin or /usr/sbin"
        ));
    }
}

/// Wrappers that run their command as another user.
const ELEVATING: &[&str] = &["sudo", "doas"];

/// The command policy patterns judge: wrappers and leading `VAR=value` removed, the program
/// reduced to its basename (`/usr/bin/sudo -n /bin/rm -rf /` -> `rm -rf /`), so a wrapper
/// cannot hide a forbidden program, and `ip`'s and `tc`'s abbreviations spelled out (`ip l s
/// eth0 down` -> `ip link set eth0 down`, `tc q a ...` -> `tc qdisc add ...`). On the way it
/// notes whether a privilege wrapper was there, which files wrappers write, whether wrappers
/// or assignments make it more than read-only, and whether the inner command could not be
/// told for sure: more wrappers than [`MAX_UNWRAP`], or `env -S` (which splits its argument
/// with escapes of its own, `\c` ending it early: the words the gate would judge are not the
/// words env runs).
pub(crate) fn unwrap(argv: &[String]) -> Unwrapped {
    let mut rest: Vec<String> = argv.to_vec();
    let mut out = Unwrapped::default();
    let mut unwrapped = 0;
    // `rest` is a tail of `argv` until `env -S` makes words of its own.
    let mut a_tail = true;
    loop {
        let skip = rest.iter().take_while(|w| is_assignment(w)).count();
        let names: Vec<String> = rest.drain(..skip).map(|a| a.split('=').next().unwrap_or(&a).to_string()).collect();
        if let Some(name) = names.iter().find(|n| !read_only_assignment(n)) {
            out.not_read_only.get_or_insert_with(|| format!("`{name}=` changes what the program does"));
        }
        out.assignments.extend(names);
        let Some(first) = rest.first() else { break };
        // sudo under the names its other builds go by (`sudo-rs`, Ubuntu's; `sudo.ws`).
        let name = match basename(first) {
            "sudo-rs" | "sudo.ws" => "sudo",
            name => name,
        };
        let Some(w) = WRAPPERS.iter().find(|w| w.name == name) else {
            break;
        };
        note_unless_system_program(&mut out, first);
        if unwrapped == MAX_UNWRAP {
            out.opaque = Some(format!("wrapped in more than {MAX_UNWRAP} programs that run other programs"));
            break;
        }
        unwrapped += 1;
        out.elevated |= ELEVATING.contains(&w.name);
        let skipped = skip_options(&rest[1..], w);
        if out.not_read_only.is_none() {
            out.not_read_only = not_read_only(w, &skipped.options);
        }
        for (_, names) in OUTPUT_OPTIONS.iter().filter(|(name, _)| *name == w.name) {
            // Every one: getopt keeps the last, and the gate need not know which.
            out.writes.extend(skipped.values_of(names));
        }
        let mut inner: Vec<String> = rest[1 + skipped.end..].to_vec();
        // `sudo -e FILE...` runs no command: it edits the files as root (`sudoedit`).
        if w.name == "sudo"
            && skipped.options.iter().any(|o| o == "-e" || (o.len() >= 3 && "--edit".starts_with(o.as_str())))
        {
            a_tail = false;
            inner.insert(0, "sudoedit".into());
            rest = inner;
            break;
        }
        // `sudo -s`/`-i` run the command through root's shell, which expands `$HOME` and the
        // like that the gate read as plain words (sudo escapes `;`, not `$`).
        // Long ones as getopt takes them, by any unique prefix (`--lo`, `--sh`).
        let shell_option = |o: &str| {
            ["-s", "-i"].contains(&o) || (o.len() >= 4 && ["--login", "--shell"].iter().any(|l| l.starts_with(o)))
        };
        if w.name == "sudo" && skipped.options.iter().any(|o| shell_option(o)) {
            out.opaque.get_or_insert_with(|| {
                "`sudo -s`/`sudo -i` runs the command through root's shell, which expands words the gate read as \
                 plain"
                    .into()
            });
        }
        // A program that chooses what it does by the name it is called by (systemctl as
        // `reboot`, busybox as `rm`, pgrep as `pkill`) would do what the gate did not read.
        if skipped.values_of(&["-a", "--argv0"]).next().is_some() {
            out.opaque.get_or_insert_with(|| {
                format!("`{} -a` runs the program under another name, which some take for what to do", w.name)
            });
        }
        let split = if w.name == "env" { skipped.values_of(&["-S", "--split-string"]).next() } else { None };
        if let Some(line) = split {
            a_tail = false;
            out.opaque.get_or_insert_with(|| {
                "`env -S` splits its argument by rules of its own: what it runs cannot be told".into()
            });
            let mut words = shell_words::split(&line).unwrap_or_else(|_| vec![line]);
            words.append(&mut inner);
            inner = words;
        }
        rest = inner;
    }
    out.index = (a_tail && !rest.is_empty()).then(|| argv.len() - rest.len());
    if let Some(first) = rest.first_mut() {
        out.path = first.clone();
        note_unless_system_program(&mut out, first);
        *first = basename(first).to_string();
    }
    let spelled_out = match rest.first().map(String::as_str) {
        Some("ip") => Some(crate::ip::normalise(&rest[1..])),
        Some("tc") => Some(crate::tc::normalise(&rest[1..])),
        _ => None,
    };
    if let Some(args) = spelled_out {
        rest.truncate(1);
        rest.extend(args);
    }
    out.argv = rest;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(cmd: &str) -> String {
        unwrap(&shell_words::split(cmd).unwrap()).argv.join(" ")
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
        let unwrapped =
            Unwrapped { argv: vec!["reboot".into()], path: "reboot".into(), index: Some(8), ..Default::default() };
        assert_eq!(of(&eight), unwrapped);
        assert_eq!(of("sudo -u app kill 1").index, Some(3), "the program's place among the words");
        assert_eq!(of("sudo /opt/app/bin/start -p 1").path, "/opt/app/bin/start");
        for cmd in ["env -S 'reboot\\c'", "env --split-string='rm x'", "sudo env -S'ls' x", "env --split 'reboot\\c'"] {
            assert!(of(cmd).opaque.is_some_and(|why| why.contains("env -S")), "{cmd}");
        }
    }

    /// getopt reads `--out` as `--output`: the file is seen, and the value is not taken for
    /// the program.
    #[test]
    fn files_wrappers_write_are_noted_however_the_option_is_spelled() {
        let of = |cmd: &str| unwrap(&shell_words::split(cmd).unwrap());
        let u = of("sudo time -o /etc/passwd true");
        assert_eq!((u.argv, u.writes), (vec!["true".to_string()], vec!["/etc/passwd".to_string()]));
        let u = of("time --output=/a -ao/b --out /c --outp /d -f %e true");
        assert_eq!(u.writes, ["/a", "/b", "/c", "/d"]);
        assert_eq!(u.argv, ["true"]);
        assert!(of("time -p uptime").writes.is_empty());
    }

    #[test]
    fn read_only_wrappers_take_only_options_that_neither_write_nor_reach_other_processes() {
        let of = |cmd: &str| unwrap(&shell_words::split(cmd).unwrap()).not_read_only;
        for ok in
            ["sudo -n -u app uptime", "sudo -nuapp uptime", "nice -n 5 timeout -s KILL 5 uptime", "LC_ALL=C uptime"]
        {
            assert_eq!(of(ok), None, "{ok}");
        }
        for bad in
            ["ionice -p 1 uptime", "time -o x uptime", "chroot /r uptime", "sudo -e /etc/hosts", "PAGER=x uptime"]
        {
            assert!(of(bad).is_some(), "{bad}");
        }
        assert_eq!(norm("sudo /sbin/ip -s l s eth0 down"), "ip -stats link set eth0 down");
        assert_eq!(norm("sudo /sbin/tc -s q a dev eth0 root netem"), "tc -stats qdisc add dev eth0 root netem");
    }
}
