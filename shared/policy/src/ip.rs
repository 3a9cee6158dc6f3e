//! iproute2's `ip` reads any prefix of an option, an object or a verb as the first one it
//! begins (`ip l s eth0 down` is `ip link set eth0 down`, `ip r d default` is `ip route
//! delete default`): rules and the read-only class judge it spelled out in full. `tc` reads
//! its command line the same way (see [`crate::tc`]).

/// How an iproute2 program reads its command line.
pub(crate) struct Grammar {
    /// Its options in the order it tries them: (name, only the exact word counts, a value
    /// follows). `-color` may carry `=always|auto|never`.
    pub options: &'static [(&'static str, bool, bool)],
    /// Its objects in the order it tries them, each with its verbs in the order that object
    /// tries them (empty: verbs left as written).
    pub objects: &'static [(&'static str, &'static [&'static str])],
    /// `--` ends the options and `--stats` is `-stats` (ip); tc reads neither (it refuses them).
    pub double_dash: bool,
}

const IP: Grammar = Grammar { options: OPTIONS, objects: OBJECTS, double_dash: true };

/// ip's options in the order it tries them: (name, only the exact word counts, a value
/// follows). `-color` may carry `=always|auto|never`.
const OPTIONS: &[(&str, bool, bool)] = &[
    ("-loops", false, true),
    ("-family", false, true),
    ("-4", true, false),
    ("-6", true, false),
    ("-0", true, false),
    ("-I", true, false),
    ("-D", true, false),
    ("-M", true, false),
    ("-B", true, false),
    ("-human", false, false),
    ("-human-readable", false, false),
    ("-iec", false, false),
    ("-stats", false, false),
    ("-statistics", false, false),
    ("-details", false, false),
    ("-resolve", false, false),
    ("-oneline", false, false),
    ("-timestamp", false, false),
    ("-tshort", false, false),
    ("-Version", false, false),
    ("-force", false, false),
    ("-batch", false, true),
    ("-brief", false, false),
    ("-json", false, false),
    ("-pretty", false, false),
    ("-rcvbuf", false, true),
    ("-color", false, false),
    ("-help", false, false),
    ("-netns", false, true),
    ("-Numeric", false, false),
    ("-all", false, false),
    ("-echo", true, false),
];

const ADDRESS: &[&str] = &[
    "add", "change", "chg", "replace", "delete", "list", "show", "lst", "flush", "save", "showdump", "restore", "help",
];
const ROUTE: &[&str] = &[
    "add", "change", "chg", "replace", "prepend", "append", "test", "delete", "list", "show", "lst", "get", "flush",
    "save", "restore", "showdump", "help",
];
const RULE: &[&str] = &["list", "lst", "show", "save", "restore", "add", "delete", "flush", "help"];
const NEIGH: &[&str] = &["add", "change", "chg", "replace", "delete", "get", "show", "lst", "list", "flush", "help"];
const LINK: &[&str] =
    &["add", "set", "change", "replace", "delete", "show", "lst", "list", "xstats", "afstats", "property", "help"];
const MADDRESS: &[&str] = &["add", "delete", "list", "show", "lst", "help"];
const NETNS: &[&str] = &[
    "list", "show", "lst", "list-id", "help", "add", "set", "delete", "identify", "pids", "exec", "monitor", "attach",
];
const VRF: &[&str] = &["identify", "pids", "exec", "show", "lst", "list", "help"];
const NEXTHOP: &[&str] = &["add", "replace", "delete", "list", "show", "lst", "get", "flush", "bucket", "help"];

/// ip's objects in the order it tries them, each with its verbs in the order that object
/// tries them (empty: verbs left as written; the read-only class admits none of those).
const OBJECTS: &[(&str, &[&str])] = &[
    ("address", ADDRESS),
    ("addrlabel", &[]),
    ("maddress", MADDRESS),
    ("route", ROUTE),
    ("rule", RULE),
    ("neighbor", NEIGH),
    ("neighbour", NEIGH),
    ("ntable", &[]),
    ("ntbl", &[]),
    ("link", LINK),
    ("l2tp", &[]),
    ("fou", &[]),
    ("ila", &[]),
    ("macsec", &[]),
    ("tunnel", &[]),
    ("tunl", &[]),
    ("tuntap", &[]),
    ("tap", &[]),
    ("token", &[]),
    ("tcpmetrics", &[]),
    ("tcp_metrics", &[]),
    ("monitor", &[]),
    ("xfrm", &[]),
    ("mroute", &[]),
    ("mrule", RULE),
    ("netns", NETNS),
    ("netconf", &[]),
    ("vrf", VRF),
    ("sr", &[]),
    ("nexthop", NEXTHOP),
    ("mptcp", &[]),
    ("ioam", &[]),
    ("help", &[]),
    ("stats", &[]),
];

/// The first of `names` that `word` begins. An empty word begins them all: older ip read it
/// so, and reading it as ip might is the cautious way.
fn expand<'a>(word: &str, names: &[&'a str]) -> Option<&'a str> {
    names.iter().copied().find(|n| n.starts_with(word))
}

/// The option `word` is to `grammar`, by its full name, and whether its value follows.
fn option(grammar: &Grammar, word: &str) -> Option<(&'static str, bool)> {
    // `--stats` is `-stats` to ip.
    let word = if grammar.double_dash && word.starts_with("--") { &word[1..] } else { word };
    grammar.options.iter().find_map(|&(name, exact, value)| {
        let given = if name == "-color" { word.split('=').next().unwrap_or(word) } else { word };
        let hit = if exact { given == name } else { name.starts_with(given) };
        hit.then_some((name, value))
    })
}

/// The verbs of `object` (a full name), in the order ip tries them.
pub(crate) fn verbs(object: &str) -> &'static [&'static str] {
    OBJECTS.iter().find(|(name, _)| *name == object).map_or(&[], |(_, verbs)| verbs)
}

/// `ip`'s arguments spelled out in full: options by their full names, their values dropped
/// (rules judge what ip does, not where: `ip -n ns1 l s eth0 down` is `ip -netns link set
/// eth0 down`); the object and its verb by their full names; the rest as written. An option
/// ip does not know is kept as written (ip refuses it).
pub(crate) fn normalise(args: &[String]) -> Vec<String> {
    spell_out(&IP, args)
}

/// The arguments of a program that reads them by `grammar`, spelled out in full as
/// [`normalise`] spells out ip's.
pub(crate) fn spell_out(grammar: &Grammar, args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut i = 0;
    while let Some(a) = args.get(i) {
        if grammar.double_dash && a == "--" {
            i += 1;
            break;
        }
        if !a.starts_with('-') {
            break;
        }
        match option(grammar, a) {
            Some((name, value)) => {
                out.push(name.to_string());
                i += usize::from(value);
            }
            None => out.push(a.clone()),
        }
        i += 1;
    }
    let Some(object) = args.get(i) else { return out };
    let Some(&(name, verbs)) = grammar.objects.iter().find(|(name, _)| name.starts_with(object.as_str())) else {
        out.extend_from_slice(&args[i..]);
        return out;
    };
    out.push(name.to_string());
    if let Some(verb) = args.get(i + 1) {
        out.push(expand(verb, verbs).unwrap_or(verb).to_string());
        out.extend_from_slice(&args[i + 2..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(args: &str) -> String {
        normalise(&shell_words::split(args).unwrap()).join(" ")
    }

    #[test]
    fn abbreviations_are_spelled_out_as_ip_reads_them() {
        for (given, want) in [
            ("l s eth0 down", "link set eth0 down"),
            ("a f dev eth0", "address flush dev eth0"),
            ("r d default", "route delete default"),
            ("ro prep default via 10.0.0.1", "route prepend default via 10.0.0.1"),
            ("route chg default via 10.0.0.1", "route chg default via 10.0.0.1"),
            ("a s", "address show"),
            ("r s", "route show"),
            ("r g 1.1.1.1", "route get 1.1.1.1"),
            ("n", "neighbor"),
            ("ru f", "rule flush"),
            ("net e ns1 reboot", "netns exec ns1 reboot"),
            ("-s -br a", "-stats -brief address"),
            ("-b /tmp/cmds", "-batch"),
            ("--ba /tmp/cmds", "-batch"),
            ("-n ns1 l s eth0 down", "-netns link set eth0 down"),
            ("-f inet -c=always -- a", "-family -color address"),
            ("-x link", "-x link"),
            ("'' f dev eth0", "address flush dev eth0"),
            ("frob x", "frob x"),
            ("nex f", "nexthop flush"),
            ("nexthop d id 4", "nexthop delete id 4"),
            ("nexthop r id 4 via 10.0.0.1", "nexthop replace id 4 via 10.0.0.1"),
        ] {
            assert_eq!(norm(given), want, "ip {given}");
        }
        assert_eq!(verbs("link")[1], "set");
        assert!(verbs("frob").is_empty());
    }
}
