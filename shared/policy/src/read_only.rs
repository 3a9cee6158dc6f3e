//! The read-only class: the programs evidence and a model's diagnostic calls may run, each
//! with the arguments that keep it reading. `systemctl`, `service`, `ip`, `ss`, `journalctl`,
//! `tail`, `netstat` and `ps` take allow-lists: an option or verb not named here is refused,
//! however harmless, so a new or abbreviated one cannot slip past. `cat`, `head` and `tail`
//! read any file but a process's environment (`/proc/<pid>/environ`: pitcrew's own holds its
//! secrets), a device (anything under a `dev` directory), a file that reading consumes
//! (`/proc/kmsg`, a `trace_pipe`, init's `initctl` FIFO) or a credential file (the gate's
//! `credential-file` finding, which the class refuses with every other finding), and `cat`
//! and `head` take any option (none of theirs writes). Every program, wrappers too, is named
//! bare or by its path in /bin, /sbin, /usr/bin or /usr/sbin: the class knows programs by
//! name, and an application's own `bin/test` is not `test`. `free`, `uptime`, `uname` and
//! `test` take any arguments, `df` and `pgrep` any but a device or a file reading consumes
//! (both open what they are given) and `df` not `--sync`: none of theirs writes, reaches
//! another host or shows an environment (`free -s N` repeats until stopped, as `tail -f`
//! would: the executor's time limit ends it).

type Check = fn(&[String]) -> Result<(), String>;

/// Programs that only read, each with the check its arguments must pass.
const PROGRAMS: &[(&str, Check)] = &[
    ("cat", files),
    ("tail", tail),
    ("head", files),
    ("ss", ss),
    ("netstat", netstat),
    ("df", df),
    ("free", any),
    ("uptime", any),
    ("ps", ps),
    ("pgrep", no_device),
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

/// A file argument that may name a process's environment: `/proc/<pid>/environ`, however the
/// path is spelled (`/proc//self/./environ`, `/proc/thread-self/environ`, `/proc/1/task/1/
/// environ`, `/dev/fd/../environ`). Any argument with `environ` in it is refused: the cautious
/// reading, `/etc/environment` included.
fn names_environment(argv: &[String]) -> Option<&String> {
    argv[1..].iter().find(|a| a.contains("environ"))
}

/// A file argument under a `dev` directory, however reached (`/dev/sda`, `/proc/1/root/dev/
/// watchdog`, `../dev/x`): reading a device can change the machine (opening the watchdog
/// arms it), read a raw disk past the credential-file check, or take a FIFO's data.
fn names_device(argv: &[String]) -> Option<&String> {
    argv[1..].iter().find(|a| a.split('/').any(|part| part == "dev"))
}

/// A file whose reading takes its data from whoever else reads it, or waits for data that
/// may never come: the kernel's log as syslog reads it (`/proc/kmsg`: what is read is gone
/// from the log buffer, an OOM kill's lines among it), a tracing pipe, init's control FIFO.
fn names_consumed(argv: &[String]) -> Option<&String> {
    argv[1..].iter().find(|a| {
        let name = a.rsplit(['/', '=']).next().unwrap_or(a);
        name == "kmsg" || name.starts_with("trace_pipe") || name == "initctl"
    })
}

/// No device and no file that reading consumes (`df` and `pgrep -F` open what they are
/// given: `df /dev/watchdog` arms the watchdog as `cat` would).
fn no_device(argv: &[String]) -> Result<(), String> {
    if let Some(file) = names_device(argv) {
        return Err(format!("`{} {file}` opens a device: read-only calls read files", argv[0]));
    }
    if let Some(file) = names_consumed(argv) {
        return Err(format!("`{} {file}` takes what it reads from whoever else reads it, or waits for it", argv[0]));
    }
    Ok(())
}

/// `df`: any options but `--sync` (any abbreviation), which flushes every filesystem (a
/// storm of writes on a host whose disks are the incident), on no device.
fn df(argv: &[String]) -> Result<(), String> {
    if let Some(sync) = argv[1..].iter().find(|a| a.len() > 3 && "--sync".starts_with(a.as_str())) {
        return Err(format!("`df {sync}` flushes every filesystem before it reads"));
    }
    no_device(argv)
}

/// `cat` and `head`: any options (none writes), any file but a process's environment, a
/// device or a file that reading consumes.
fn files(argv: &[String]) -> Result<(), String> {
    if let Some(file) = names_environment(argv) {
        return Err(format!("`{} {file}` may read a process's environment (pitcrew's own holds its secrets)", argv[0]));
    }
    no_device(argv)
}

fn ps(argv: &[String]) -> Result<(), String> {
    crate::ps::check(&argv[1..])
}

/// `systemctl VERB ...` for a verb that only shows, with options that only change how:
/// `-H`/`--host` and `-M`/`--machine` reach another machine, `-r` local containers, and the
/// others are not needed to show.
const SYSTEMCTL: Getopt = Getopt {
    flags: "ahlq",
    with_value: "tpPno",
    optional_value: "",
    long: &[
        "all",
        "full",
        "quiet",
        "no-pager",
        "no-legend",
        "value",
        "plain",
        "failed",
        "system",
        "show-types",
        "with-dependencies",
        "reverse",
        "help",
    ],
    long_with_value: &["type", "state", "property", "lines", "output", "legend", "timestamp"],
};

/// `systemctl show` prints a unit's `Environment=` among its properties (pitcrew's own unit
/// may set its secrets there): it is read-only only with `-p`/`--property`/`-P` naming
/// properties, none of them an environment.
fn systemctl(argv: &[String]) -> Result<(), String> {
    const VERBS: &[&str] = &["status", "is-active", "is-failed", "show", "list-units"];
    let Some(verb) = argv.get(1).filter(|v| VERBS.contains(&v.as_str())) else {
        return Err(format!("`systemctl` is read-only only as: {}", VERBS.join(", ")));
    };
    let options = read(&argv[1..], &SYSTEMCTL).map_err(|bad| {
        format!(
            "`systemctl {bad}` is not read-only: systemctl shows this host's units here \
             (e.g. status UNIT -n 50 --no-pager; never -H or -M)"
        )
    })?;
    if verb == "show" {
        let properties =
            || options.iter().filter(|(o, _)| ["-p", "-P", "--property"].contains(&o.as_str())).map(|(_, v)| *v);
        let environment = properties().any(|p| p.is_none_or(|p| p.to_ascii_lowercase().contains("environ")));
        if properties().next().is_none() || environment {
            return Err("`systemctl show` is read-only only with -p PROPERTY naming no environment \
                        (a unit's Environment= may hold secrets: pitcrew's own)"
                .into());
        }
    }
    Ok(())
}

/// Exactly `service <name> status`: Debian's `service` hands every word on to the init
/// script or systemctl (`service web restart status` restarts), and `--status-all` runs every
/// init script there is.
fn service(argv: &[String]) -> Result<(), String> {
    // `service` runs `/etc/init.d/<name>` where systemd does not run (`../../usr/bin/touch`
    // would run touch), and hands an unquoted name to systemctl where it does (`web -H
    // root@elsewhere` would reach another host): a unit's name, nothing else.
    let unit = |name: &str| {
        name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || "@._:-".contains(c))
            && !name.contains("..")
    };
    match argv {
        [_, name, verb] if unit(name) && verb == "status" => Ok(()),
        _ => Err("`service` is read-only only as `service <name> status`, the name a unit's".into()),
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
    /// Short options whose value is required: the rest of their word, else the next word
    /// whatever it looks like (getopt reads `-S -1h` as -S with the value `-1h`).
    with_value: &'static str,
    /// Short options whose value is optional: only the rest of their word is one, and a next
    /// word is judged as any other (journalctl's `-n` and `-b` look at it, but take only a
    /// number or a boot id).
    optional_value: &'static str,
    /// Long options that take no value, or an optional one (`--lines=N`: attached only).
    /// Spelled out in full only: getopt takes any unambiguous prefix too, and which option a
    /// prefix names depends on the program's version (`--k` is `ss --kill`).
    long: &'static [&'static str],
    /// Long options whose value is required: `--since=VALUE`, or `--since VALUE` whatever the
    /// next word looks like. Spelled out in full only.
    long_with_value: &'static [&'static str],
}

/// Each option in `args` as getopt reads it (`-p`, `--property`), with its value when it
/// takes one; `Err` with the first word that looks like an option `allowed` does not admit.
/// The next word is a required value whatever it looks like (`journalctl --since -1h`; in
/// `journalctl -u -- -f`, `--` is -u's value and `-f` follows), so it is not judged. getopt
/// permutes, so options after the positionals count too, and a `--` that ends the options is
/// not trusted to: every word after it that looks like an option is judged as well. `-1` is a
/// number, not an option (`journalctl -b -1`).
fn read<'a>(args: &'a [String], allowed: &Getopt) -> Result<Vec<(String, Option<&'a str>)>, &'a str> {
    let mut found = Vec::new();
    let mut words = args.iter();
    while let Some(a) = words.next() {
        if a == "--" {
            continue;
        }
        if let Some(long) = a.strip_prefix("--") {
            let (name, attached) = match long.split_once('=') {
                Some((name, value)) => (name, Some(value)),
                None => (long, None),
            };
            if allowed.long_with_value.contains(&name) {
                found.push((format!("--{name}"), attached.or_else(|| words.next().map(String::as_str))));
            } else if allowed.long.contains(&name) {
                found.push((format!("--{name}"), attached));
            } else {
                return Err(a);
            }
            continue;
        }
        let Some(cluster) = a.strip_prefix('-').filter(|c| !c.is_empty()) else { continue };
        if cluster.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        for (j, c) in cluster.char_indices() {
            let rest = &cluster[j + c.len_utf8()..];
            if allowed.with_value.contains(c) {
                let value = if rest.is_empty() { words.next().map(String::as_str) } else { Some(rest) };
                found.push((format!("-{c}"), value));
                break;
            }
            if allowed.optional_value.contains(c) {
                found.push((format!("-{c}"), Some(rest).filter(|r| !r.is_empty())));
                break;
            }
            if !allowed.flags.contains(c) {
                return Err(a);
            }
            found.push((format!("-{c}"), None));
        }
    }
    Ok(found)
}

fn only(program: &str, argv: &[String], allowed: &Getopt, why: &str) -> Result<(), String> {
    match read(&argv[1..], allowed) {
        Err(option) => Err(format!("`{program} {option}` is not read-only: {why}")),
        Ok(_) => Ok(()),
    }
}

/// `ss` shows sockets; `-K` closes them, `-D FILE` writes FILE, `-F FILE` reads its filter
/// from a file, `-N` enters another namespace, `-E` follows events and never ends.
const SS: Getopt = Getopt {
    flags: "hVvaletuwxnro460spbmiHMOSTdzZ",
    with_value: "fA",
    optional_value: "",
    long_with_value: &["family", "query", "socket"],
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
/// (another journal or machine). Its options with a required value: `-o -p -g -c -S -U -t -T
/// -u -F` and their long names, `--user-unit`, `--facility`, `--output-fields`,
/// `--after-cursor`; `-n`/`--lines` and `-b`/`--boot` take one only attached.
const JOURNALCTL: Getopt = Getopt {
    flags: "hearlqmkNxW",
    with_value: "opgcSUtTuF",
    optional_value: "nb",
    long: &[
        "lines",
        "no-pager",
        "boot",
        "dmesg",
        "reverse",
        "pager-end",
        "catalog",
        "quiet",
        "all",
        "full",
        "no-full",
        "merge",
        "case-sensitive",
        "utc",
        "no-hostname",
        "no-tail",
        "system",
        "user",
        "show-cursor",
        "list-boots",
        "disk-usage",
        "fields",
        "truncate-newline",
        "help",
        "version",
    ],
    long_with_value: &[
        "unit",
        "user-unit",
        "priority",
        "facility",
        "since",
        "until",
        "output",
        "output-fields",
        "grep",
        "identifier",
        "exclude-identifier",
        "cursor",
        "after-cursor",
        "field",
    ],
};

fn journalctl(argv: &[String]) -> Result<(), String> {
    only("journalctl", argv, &JOURNALCTL, "journalctl only reads here (e.g. -u UNIT -n 50 --since today --no-pager)")
}

/// `tail` reads; `-f`/`-F`/`--follow` (and `--pid`, `--retry`, `-s` that go with it) never end.
const TAIL: Getopt = Getopt {
    flags: "qvz",
    with_value: "nc",
    optional_value: "",
    long: &["quiet", "silent", "verbose", "zero-terminated", "help", "version"],
    long_with_value: &["lines", "bytes"],
};

fn tail(argv: &[String]) -> Result<(), String> {
    files(argv)?;
    // The obsolete form (`tail +1f FILE`, `tail -5f`) takes its count, and `f`, in one word:
    // a `+` word is only the value of -n or -c.
    let mut after = "";
    for word in &argv[1..] {
        if word.starts_with('+') && !["-n", "-c", "--lines", "--bytes"].contains(&after) {
            return Err(format!("`tail {word}` is tail's obsolete form (use -n +N)"));
        }
        after = word;
    }
    only("tail", argv, &TAIL, "`tail -f` never ends (use -n N)")
}

/// net-tools' `netstat` shows sockets, routes and interfaces; `-c`/`--continuous` never ends.
const NETSTAT: Getopt = Getopt {
    flags: "CFMadeghilnNoprsStuUvVWw2fx46Z",
    with_value: "A",
    optional_value: "",
    long: &[
        "route",
        "interfaces",
        "groups",
        "statistics",
        "masquerade",
        "verbose",
        "wide",
        "numeric",
        "numeric-hosts",
        "numeric-ports",
        "numeric-users",
        "symbolic",
        "extend",
        "programs",
        "timers",
        "listening",
        "all",
        "fib",
        "cache",
        "context",
        "tcp",
        "udp",
        "udplite",
        "sctp",
        "raw",
        "unix",
        "inet",
        "inet6",
        "help",
        "version",
    ],
    long_with_value: &["protocol"],
};

fn netstat(argv: &[String]) -> Result<(), String> {
    only("netstat", argv, &NETSTAT, "`netstat -c` never ends (e.g. netstat -tlnp)")
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
            "ps eww 1234",
            "ps -ex",
            "cat /proc/self/environ",
            "systemctl status -H db1 web",
            "netstat -c",
        ] {
            assert!(refused_here(cmd), "{cmd}");
        }
        for cmd in [
            "service web status",
            "ip -br a s",
            "ss -Hltnp sport = :8080",
            "journalctl -u web -n 50 --no-pager",
            "journalctl --since -1h -u web",
            "ps -ef",
            "systemctl status web --no-pager",
        ] {
            assert!(!refused_here(cmd), "{cmd}");
        }
    }
}
