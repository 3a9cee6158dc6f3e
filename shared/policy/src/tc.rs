//! iproute2's `tc` reads its command line as `ip` does: any prefix of an option, an object or
//! a verb is the first one it begins (`tc q a dev eth0 root netem loss 100%` is `tc qdisc add
//! dev eth0 root netem loss 100%`, `tc -b FILE` is `tc -batch FILE`): rules judge it spelled
//! out in full. Unlike ip, tc reads `--` and `--stats` as unknown options, and refuses them.

use crate::ip::Grammar;

/// tc's options in the order it tries them (tc.c): (name, only the exact word counts, a value
/// follows). `-c` is `-cf` (a file follows), not `-color`: tc tries `-cf` first.
const OPTIONS: &[(&str, bool, bool)] = &[
    ("-stats", false, false),
    ("-statistics", false, false),
    ("-details", false, false),
    ("-raw", false, false),
    ("-pretty", false, false),
    ("-graph", false, false),
    ("-Version", false, false),
    ("-iec", false, false),
    ("-help", false, false),
    ("-force", false, false),
    ("-batch", false, true),
    ("-netns", false, true),
    ("-Numeric", false, false),
    ("-names", false, false),
    ("-nm", false, false),
    ("-cf", false, true),
    ("-conf", false, true),
    ("-color", false, false),
    ("-timestamp", false, false),
    ("-tshort", false, false),
    ("-json", false, false),
    ("-oneline", false, false),
    ("-brief", false, false),
    ("-echo", true, false),
];

const QDISC: &[&str] = &["add", "change", "replace", "link", "delete", "list", "show", "lst", "get", "help"];
const CLASS: &[&str] = &["add", "change", "replace", "delete", "list", "show", "lst", "help"];
const FILTER: &[&str] = &["add", "change", "replace", "delete", "get", "list", "show", "lst", "help"];
const CHAIN: &[&str] = &["add", "delete", "get", "list", "show", "lst", "help"];
/// `tc actions` reads a verb again after each `get` or `delete` and its actions: rules look
/// past the first.
const ACTIONS: &[&str] = &["add", "change", "replace", "delete", "get", "list", "show", "lst", "flush", "help"];

/// tc's objects in the order it tries them, each with its verbs in the order that object
/// tries them. `exec` runs a program (`tc exec bpf ... run CMD`).
const OBJECTS: &[(&str, &[&str])] = &[
    ("qdisc", QDISC),
    ("class", CLASS),
    ("filter", FILTER),
    ("chain", CHAIN),
    ("actions", ACTIONS),
    ("monitor", &[]),
    ("exec", &[]),
    ("help", &[]),
];

const TC: Grammar = Grammar { options: OPTIONS, objects: OBJECTS, double_dash: false };

/// `tc`'s arguments spelled out in full: options by their full names, their values dropped
/// (`tc -n ns1 q a dev eth0 ...` is `tc -netns qdisc add dev eth0 ...`); the object and its
/// verb by their full names; the rest as written.
pub(crate) fn normalise(args: &[String]) -> Vec<String> {
    crate::ip::spell_out(&TC, args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(args: &str) -> String {
        normalise(&shell_words::split(args).unwrap()).join(" ")
    }

    #[test]
    fn abbreviations_are_spelled_out_as_tc_reads_them() {
        for (given, want) in [
            ("q a dev eth0 root netem loss 100%", "qdisc add dev eth0 root netem loss 100%"),
            ("-s qdisc add dev eth0 root netem", "-stats qdisc add dev eth0 root netem"),
            ("-s -d q s dev eth0", "-stats -details qdisc show dev eth0"),
            ("q l dev eth0 root", "qdisc link dev eth0 root"),
            ("q r dev eth0 root fq", "qdisc replace dev eth0 root fq"),
            ("c s dev eth0", "class show dev eth0"),
            ("c l dev eth0", "class list dev eth0"),
            ("ch a dev eth0 chain 1", "chain add dev eth0 chain 1"),
            ("f a dev eth0 ingress matchall action drop", "filter add dev eth0 ingress matchall action drop"),
            ("f del dev eth0 ingress", "filter delete dev eth0 ingress"),
            ("a fl action gact", "actions flush action gact"),
            ("action g action gact index 1", "actions get action gact index 1"),
            ("e bpf run /bin/sh", "exec bpf run /bin/sh"),
            ("-b /tmp/cmds", "-batch"),
            ("-force -batch /tmp/cmds", "-force -batch"),
            ("-n ns1 q a dev eth0 root netem", "-netns qdisc add dev eth0 root netem"),
            ("-c /etc/x q a dev eth0", "-cf qdisc add dev eth0"),
            ("-col=always -j -p q", "-color -json -pretty qdisc"),
            ("-br -t q", "-brief -timestamp qdisc"),
            ("-nm q", "-nm qdisc"),
            ("'' a dev eth0 root netem", "qdisc add dev eth0 root netem"),
            ("q '' dev eth0 root netem", "qdisc add dev eth0 root netem"),
            // tc refuses these: kept as written.
            ("-- q a dev eth0", "-- qdisc add dev eth0"),
            ("--stats q", "--stats qdisc"),
            ("frob x", "frob x"),
        ] {
            assert_eq!(norm(given), want, "tc {given}");
        }
    }
}
