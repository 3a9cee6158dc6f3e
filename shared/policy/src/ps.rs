//! procps's `ps` reads three kinds of options: UNIX (`-ef`), BSD (`aux`) and GNU (`--sort`).
//! BSD `e` shows each process's environment after its command, and pitcrew's own environment
//! holds its secrets (`ps eww <pid>`). When ps cannot read its arguments the UNIX way (`-x`,
//! `-u` naming no user, `-H` with `-T`...), it reads them again the BSD way, dash options
//! included: `-e` (every process) is then `e` (`ps -ex`, `ps -eaux` and `ps -eTH` show every
//! environment ps can read). So the read-only class admits `ps` when neither reading can show
//! one: BSD options without `e`, and `e` in dash options only among those that cannot make
//! the UNIX reading fail (`ps -ef`, `ps -eo pid,args --sort=-%mem`).

/// UNIX options that take no value (`-x` is not one: procps refuses it, and rereads as BSD).
const UNIX_FLAGS: &str = "AFHLMNPTVZacdefjlmwy";
/// UNIX options that take a value: the rest of their word, else the next word.
const UNIX_VALUES: &str = "CGOUgopqstu";
/// BSD options that take no value, but `e` (the environment).
const BSD_FLAGS: &str = "HLMSTVXZacfghjlmnrsuvwx";
/// BSD options that take a value: the rest of their word, else the next word.
const BSD_VALUES: &str = "OUkopqt";
/// The BSD options ps reads in dash options once it reads them again the BSD way: those of
/// [`BSD_FLAGS`] but `L` and `V` (which stand alone, so fail there), and `e`.
const BSD_REREAD_FLAGS: &str = "HMSTXZacefghjlmnrsuvwx";
/// GNU options, spelled out in full (ps takes no prefix of them), and whether a value follows
/// (`--sort=VALUE`, `--sort:VALUE`, else the next word). None shows an environment.
const GNU: &[(&str, bool)] = &[
    ("Group", true),
    ("User", true),
    ("cols", true),
    ("columns", true),
    ("context", false),
    ("cumulative", false),
    ("deselect", false),
    ("forest", false),
    ("format", true),
    ("group", true),
    ("header", false),
    ("headers", false),
    ("heading", false),
    ("headings", false),
    ("lines", true),
    ("no-header", false),
    ("no-headers", false),
    ("no-heading", false),
    ("no-headings", false),
    ("noheader", false),
    ("noheaders", false),
    ("noheading", false),
    ("noheadings", false),
    ("pid", true),
    ("ppid", true),
    ("quick-pid", true),
    ("rows", true),
    ("sid", true),
    ("sort", true),
    ("tty", true),
    ("user", true),
    ("version", false),
    ("width", true),
];

/// UNIX options that, however combined, cannot make the UNIX reading fail where the BSD one
/// would then succeed: a command that puts `e` in a dash option may use only these. (Checked
/// against procps-ng 4.0.2 with `-e` and up to four of them, with and without `-o`, `-p` and
/// the GNU options below, and with 45,000 random commands: of the 776 that showed an
/// environment, the read-only class admitted none.)
const SURE_UNIX_FLAGS: &str = "AFHLMZadefjlw";
/// UNIX options with a value that may go with `-e`: a format (`-o`) or pids (`-p`), which
/// both readings parse alike, so a value one refuses the other refuses too.
const SURE_UNIX_VALUES: &str = "op";
/// GNU options that may go with `-e` (GNU options read alike both ways).
const SURE_GNU: &[&str] = &[
    "cols",
    "columns",
    "format",
    "forest",
    "lines",
    "no-headers",
    "noheaders",
    "pid",
    "ppid",
    "rows",
    "sort",
    "width",
];

/// What procps takes a word for (its `arg_type`).
#[derive(Debug, PartialEq)]
enum Kind {
    /// `--name`.
    Gnu,
    /// `-abc`.
    Unix,
    /// `abc`.
    Bsd,
    /// `123`, `-123` (a process group), `+123` (a session): every word from here is one.
    Pids,
    /// Anything else: ps refuses it (`--`, `-`, `-/`).
    Other,
}

fn kind(word: &str) -> Kind {
    let b = word.as_bytes();
    let letter = |i: usize| b.get(i).is_some_and(u8::is_ascii_alphabetic);
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    match b.first() {
        _ if letter(0) => Kind::Bsd,
        _ if digit(0) => Kind::Pids,
        Some(b'+') => Kind::Pids,
        Some(b'-') if letter(1) => Kind::Unix,
        Some(b'-') if digit(1) => Kind::Pids,
        Some(b'-') if b.get(1) == Some(&b'-') && letter(2) => Kind::Gnu,
        _ => Kind::Other,
    }
}

/// A GNU option's name, and whether its value is attached (`--sort=pid`, `--sort:pid`).
fn gnu(word: &str) -> (&str, bool) {
    let long = &word[2..];
    match long.find([':', '=']) {
        Some(at) => (&long[..at], true),
        None => (long, false),
    }
}

/// Whether the GNU option `word` takes the next word as its value; `None` when ps knows no
/// such option.
fn gnu_takes_next(word: &str) -> Option<bool> {
    let (name, attached) = gnu(word);
    GNU.iter().find(|(n, _)| *n == name).map(|(_, value)| *value && !attached)
}

/// Whether ps takes the word after `args[i]` as a value: there is one, and it is not empty.
fn next_is_value(args: &[String], i: usize) -> bool {
    args.get(i + 1).is_some_and(|w| !w.is_empty())
}

/// One option cluster (`ef`, `aux`, `eo`): `Err(c)` for the first option not in `flags` or
/// `values`; else whether the next word is the value of its last option.
fn cluster(options: &str, flags: &str, values: &str, digits_end: bool) -> Result<bool, char> {
    for (j, c) in options.char_indices() {
        if values.contains(c) {
            return Ok(j + c.len_utf8() == options.len());
        }
        if digits_end && c.is_ascii_digit() {
            return Ok(false);
        }
        if !flags.contains(c) {
            return Err(c);
        }
    }
    Ok(false)
}

/// Whether `ps` with `args` only reads and shows no environment.
pub(crate) fn check(args: &[String]) -> Result<(), String> {
    let refuse = |why: String| {
        Err(format!(
            "{why}: ps shows processes here without their environment \
             (e.g. ps aux, ps -ef, ps -eo pid,args, ps -p PID -o pid,etime,args)"
        ))
    };
    let mut i = 0;
    while let Some(a) = args.get(i) {
        let takes_next = match kind(a) {
            Kind::Gnu => match gnu_takes_next(a) {
                Some(takes_next) => takes_next,
                None => return refuse(format!("`ps {a}` is not read-only")),
            },
            Kind::Unix => match cluster(&a[1..], UNIX_FLAGS, UNIX_VALUES, false) {
                Ok(takes_next) => takes_next,
                Err(c) => return refuse(format!("`ps -{c}` (in `{a}`) is not read-only")),
            },
            // `e` anywhere in a BSD word, even in a value: the cautious reading.
            Kind::Bsd if a.contains('e') => {
                return refuse(format!("`ps {a}`: BSD `e` shows every process's environment"))
            }
            Kind::Bsd => match cluster(a, BSD_FLAGS, BSD_VALUES, true) {
                Ok(takes_next) => takes_next,
                Err(c) => return refuse(format!("`ps {c}` (in `{a}`) is not read-only")),
            },
            Kind::Pids => {
                let pid = |w: &String| {
                    let digits = w.strip_prefix(['-', '+']).unwrap_or(w);
                    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
                };
                return match args[i..].iter().find(|w| !pid(w)) {
                    Some(w) => refuse(format!("`ps {w}`: after a pid, ps reads only pids")),
                    None => sure(args),
                };
            }
            Kind::Other => return refuse(format!("`ps {a}` is not an option ps reads")),
        };
        i += if takes_next && next_is_value(args, i) { 2 } else { 1 };
    }
    sure(args)
}

/// The cautious end of [`check`]: refused when ps, reading `args` again the BSD way, would
/// show an environment, unless its UNIX reading cannot fail.
fn sure(args: &[String]) -> Result<(), String> {
    if bsd_rereading_shows_environment(args) && !unix_reading_cannot_fail(args) {
        return Err(format!(
            "`ps {}`: should ps fail to read it the UNIX way, it reads it again the BSD way, where `-e` \
             shows every process's environment (with `-e`, use only -{SURE_UNIX_FLAGS}, -o FORMAT, -p PIDS \
             and --{})",
            args.join(" "),
            SURE_GNU.join(" --")
        ));
    }
    Ok(())
}

/// Whether ps, reading `args` the BSD way (after its UNIX reading failed), would get to the
/// end with `e` among them. Any BSD word stops it ("way bad"); so does an option BSD does not
/// know, `L` or `V` with anything else, or `--`.
fn bsd_rereading_shows_environment(args: &[String]) -> bool {
    let mut environment = false;
    let mut i = 0;
    while let Some(a) = args.get(i) {
        let takes_next = match kind(a) {
            Kind::Gnu => match gnu_takes_next(a) {
                Some(takes_next) => takes_next,
                None => return false,
            },
            Kind::Unix => {
                let options = &a[1..];
                match cluster(options, BSD_REREAD_FLAGS, BSD_VALUES, true) {
                    Ok(takes_next) => {
                        let end = options
                            .find(|c: char| BSD_VALUES.contains(c) || c.is_ascii_digit())
                            .unwrap_or(options.len());
                        environment |= options[..end].contains('e');
                        takes_next
                    }
                    Err(_) => return false,
                }
            }
            Kind::Bsd | Kind::Other => return false,
            Kind::Pids => return environment,
        };
        i += if takes_next && next_is_value(args, i) { 2 } else { 1 };
    }
    environment
}

/// Whether ps's UNIX reading of `args` cannot fail: only [`SURE_UNIX_FLAGS`],
/// [`SURE_UNIX_VALUES`], [`SURE_GNU`] and pids.
fn unix_reading_cannot_fail(args: &[String]) -> bool {
    let mut i = 0;
    while let Some(a) = args.get(i) {
        let takes_next = match kind(a) {
            Kind::Gnu if SURE_GNU.contains(&gnu(a).0) => gnu_takes_next(a).unwrap_or(false),
            Kind::Unix => match cluster(&a[1..], SURE_UNIX_FLAGS, SURE_UNIX_VALUES, false) {
                Ok(takes_next) => takes_next,
                Err(_) => return false,
            },
            // Pids are read alike both ways: a bad one fails both.
            Kind::Pids => return true,
            Kind::Gnu | Kind::Bsd | Kind::Other => return false,
        };
        i += if takes_next && next_is_value(args, i) { 2 } else { 1 };
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ps(args: &str) -> Result<(), String> {
        check(&shell_words::split(args).unwrap())
    }

    #[test]
    fn the_environment_is_refused_however_asked_for() {
        for args in [
            "eww 1234",
            "e",
            "aux e",
            "auxe",
            "axe",
            "eww",
            "-p 1 e",
            "axo pid,args e",
            // Read again the BSD way once the UNIX reading fails: `-e` is `e` then.
            "-ex",
            "-eaux",
            "-eTH",
            "-e -m -H",
            "-e -x -o pid,args",
            "-ef -ux",
            "-uxe",
            "-u -exe",
            "-e --deselect",
            "-ef 1 2 e",
        ] {
            assert!(ps(args).is_err(), "ps {args}");
        }
    }

    #[test]
    fn forms_that_show_no_environment_are_admitted() {
        for args in [
            "",
            "aux",
            "auxf",
            "axjf",
            "axo pid,user,etime,args",
            "-ef",
            "-eF",
            "-ely",
            "-eLf",
            "-ejH",
            "-e",
            "-A",
            "-eo pid,ppid,args,%mem,%cpu --sort=-%mem",
            "-eo pid,etime,args --no-headers",
            "-p 1234",
            "-fp 1234",
            "-p 1234 -o pid,etime,args",
            "-o pid,etime,args -p 1234",
            "-fu app",
            "-u app -o pid,etime,args",
            "-C nginx -o pid,args",
            "--pid 1234 -o pid,etime",
            "--forest -ef",
            "u 1234",
            "1234",
        ] {
            assert!(ps(args).is_ok(), "ps {args}: {:?}", ps(args));
        }
    }
}
