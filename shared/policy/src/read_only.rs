//! The read-only class: the programs evidence and a model's diagnostic calls may run, each
//! with the arguments that keep it reading. Allow-lists throughout: an option or verb not
//! named here is refused, however harmless, so a new or abbreviated one cannot slip past.

type Check = fn(&[String]) -> Result<(), String>;

/// Programs that only read, each with the check its arguments must pass.
const PROGRAMS: &[(&str, Check)] = &[
    ("cat", any),
    ("tail", tail),
    ("head", any),
    ("ss", ss),
    ("netstat", any),
    ("df", any),
    ("free", any),
    ("uptime", any),
    ("ps", any),
    ("pgrep", any),
    ("journalctl", journalctl),
    ("systemctl", systemctl),
    ("service", service),
    ("ip", ip),
    ("uname", any),
    ("test", any),
];

/// Whether `argv` (normalised: wrappers gone, `ip` spelled out) only reads.
pub(crate) fn check(argv: &[String]) -> Result<(), String> {
    let Some(program) = argv.first() else { return Err("empty command".into()) };
    let Some((_, check)) = PROGRAMS.iter().find(|(p, _)| p == program) else {
        return Err(format!("`{program}` is not in the read-only class (evidence cannot run it)"));
    };
    check(argv)
}

fn any(_: &[String]) -> Result<(), String> {
    Ok(())
}

fn systemctl(argv: &[String]) -> Result<(), String> {
    const VERBS: &[&str] = &["status", "is-active", "is-failed", "show", "list-units"];
    match argv.get(1) {
        Some(verb) if VERBS.contains(&verb.as_str()) => Ok(()),
        _ => Err(format!("`systemctl` is read-only only as: {}", VERBS.join(", "))),
    }
}

/// Exactly `service <name> status`: Debian's `service` hands every word on to the init
/// script or systemctl (`service web restart status` restarts), and `--status-all` runs every
/// init script there is.
fn service(argv: &[String]) -> Result<(), String> {
    match argv {
        [_, name, verb] if !name.starts_with('-') && verb == "status" => Ok(()),
        _ => Err("`service` is read-only only as `service <name> status`".into()),
    }
}

/// Options that only change how ip shows (ip::normalise spells them out and drops values).
/// Not `-batch` (runs a file of commands), `-force`, `-netns` (another namespace), `-all`.
const IP_OPTIONS: &[&str] = &[
    "-4",
    "-6",
    "-0",
    "-B",
    "-M",
    "-family",
    "-human",
    "-human-readable",
    "-iec",
    "-stats",
    "-statistics",
    "-details",
    "-resolve",
    "-oneline",
    "-timestamp",
    "-tshort",
    "-brief",
    "-json",
    "-pretty",
    "-color",
    "-Numeric",
];
const IP_OBJECTS: &[&str] = &["address", "link", "route", "rule", "neighbor", "neighbour", "maddress"];
const IP_VERBS: &[&str] = &["show", "list", "lst", "get"];

/// `ip [OPTIONS] OBJECT [show|list|get ...]`, read after ip::normalise: any abbreviation
/// ip would take for `set`, `delete`, `flush`... is refused because it is spelled out.
fn ip(argv: &[String]) -> Result<(), String> {
    let args = &argv[1..];
    let options = args.iter().take_while(|a| a.starts_with('-')).count();
    if let Some(bad) = args[..options].iter().find(|o| !IP_OPTIONS.contains(&o.as_str())) {
        return Err(format!("`ip {bad}` is not read-only"));
    }
    let shows = |object: &str, verb: Option<&String>| {
        IP_OBJECTS.contains(&object)
            && verb.is_none_or(|v| IP_VERBS.contains(&v.as_str()) && crate::ip::verbs(object).contains(&v.as_str()))
    };
    match args.get(options) {
        Some(object) if shows(object, args.get(options + 1)) => Ok(()),
        _ => Err(format!(
            "`ip` is read-only only to show: ip [{}] {} [{}]",
            IP_OPTIONS.join("|"),
            IP_OBJECTS.join("|"),
            IP_VERBS.join("|")
        )),
    }
}

/// A program's options that only read, as getopt parses them.
struct Getopt {
    /// Short options that take no value.
    flags: &'static str,
    /// Short options that take a value: the rest of their word (or the next word, which is
    /// then judged as any other word: cautious when the value is optional).
    with_value: &'static str,
    /// Long options, spelled out in full only: getopt takes any unambiguous prefix too, and
    /// which option a prefix names depends on the program's version (`--k` is `ss --kill`).
    long: &'static [&'static str],
}

/// The first option in `args` that `allowed` does not admit. getopt permutes, so options
/// after the positionals count too; and `--` ends them only when it is not the value of the
/// option before it (`journalctl -u -- -f` follows), so every word that looks like an option
/// is judged, wherever it is. `-1` is a number, not an option (`journalctl -b -1`).
fn refused<'a>(args: &'a [String], allowed: &Getopt) -> Option<&'a str> {
    for a in args {
        if a == "--" {
            continue;
        }
        if let Some(long) = a.strip_prefix("--") {
            let name = long.split('=').next().unwrap_or(long);
            if !allowed.long.contains(&name) {
                return Some(a);
            }
            continue;
        }
        let Some(cluster) = a.strip_prefix('-').filter(|c| !c.is_empty()) else { continue };
        if cluster.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        for c in cluster.chars() {
            if allowed.with_value.contains(c) {
                break;
            }
            if !allowed.flags.contains(c) {
                return Some(a);
            }
        }
    }
    None
}

fn only(program: &str, argv: &[String], allowed: &Getopt, why: &str) -> Result<(), String> {
    match refused(&argv[1..], allowed) {
        Some(option) => Err(format!("`{program} {option}` is not read-only: {why}")),
        None => Ok(()),
    }
}

/// `ss` shows sockets; `-K` closes them, `-D FILE` writes FILE, `-F FILE` reads its filter
/// from a file, `-N` enters another namespace, `-E` follows events and never ends.
const SS: Getopt = Getopt {
    flags: "hVvaletuwxnro460spbmiHMOSTdzZ",
    with_value: "fA",
    long: &[
        "numeric",
        "resolve",
        "options",
        "extended",
        "memory",
        "info",
        "processes",
        "threads",
        "bpf",
        "dccp",
        "tcp",
        "sctp",
        "udp",
        "raw",
        "unix",
        "vsock",
        "tipc",
        "tipcinfo",
        "xdp",
        "mptcp",
        "all",
        "listening",
        "ipv4",
        "ipv6",
        "packet",
        "family",
        "socket",
        "query",
        "summary",
        "version",
        "help",
        "context",
        "contexts",
        "no-header",
        "oneline",
        "cgroup",
        "inet-sockopt",
    ],
};

fn ss(argv: &[String]) -> Result<(), String> {
    only("ss", argv, &SS, "ss only shows sockets here (e.g. -ltnp, -Htan, with a filter such as `sport = :80`)")
}

/// `journalctl` reads the journal; refused are `-f` (never ends), `--cursor-file` (writes
/// it), `--vacuum-*`, `--rotate`, `--flush`, `--sync` and the other writers, and `-D`/`-i`/`-M`
/// (another journal or machine).
const JOURNALCTL: Getopt = Getopt {
    flags: "hearlqmkNx",
    with_value: "onbpgcSUtTuF",
    long: &[
        "unit",
        "user-unit",
        "lines",
        "no-pager",
        "priority",
        "facility",
        "since",
        "until",
        "boot",
        "dmesg",
        "output",
        "output-fields",
        "reverse",
        "pager-end",
        "catalog",
        "quiet",
        "all",
        "full",
        "no-full",
        "merge",
        "grep",
        "case-sensitive",
        "identifier",
        "exclude-identifier",
        "utc",
        "no-hostname",
        "no-tail",
        "system",
        "user",
        "cursor",
        "after-cursor",
        "show-cursor",
        "list-boots",
        "disk-usage",
        "field",
        "fields",
        "truncate-newline",
        "help",
        "version",
    ],
};

fn journalctl(argv: &[String]) -> Result<(), String> {
    only("journalctl", argv, &JOURNALCTL, "journalctl only reads here (e.g. -u UNIT -n 50 --since today --no-pager)")
}

/// `tail` reads; `-f`/`-F`/`--follow` (and `--pid`, `--retry`, `-s` that go with it) never end.
const TAIL: Getopt = Getopt {
    flags: "qvz",
    with_value: "nc",
    long: &["lines", "bytes", "quiet", "silent", "verbose", "zero-terminated", "help", "version"],
};

fn tail(argv: &[String]) -> Result<(), String> {
    only("tail", argv, &TAIL, "`tail -f` never ends (use -n N)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The allow-lists refuse the review's commands by themselves, whatever the rules say.
    fn refused_here(cmd: &str) -> bool {
        let unwrapped = crate::shell::unwrap(&shell_words::split(cmd).unwrap());
        unwrapped.not_read_only.is_some() || check(&unwrapped.argv).is_err()
    }

    #[test]
    fn the_allow_lists_alone_refuse_the_review_s_commands() {
        for cmd in [
            "service web restart status",
            "ip l s eth0 down",
            "ip a f dev eth0",
            "ip r d default",
            "ip route prepend default via 10.0.0.1",
            "ip route chg default via 10.0.0.1",
            "ss --k",
            "journalctl -n1 --cursor-file=/etc/nologin",
            "time -o /srv/app/data.db uptime",
            "sudo time -o /etc/passwd true",
        ] {
            assert!(refused_here(cmd), "{cmd}");
        }
        for cmd in ["service web status", "ip -br a s", "ss -Hltnp sport = :8080", "journalctl -u web -n 50 --no-pager"]
        {
            assert!(!refused_here(cmd), "{cmd}");
        }
    }
}
