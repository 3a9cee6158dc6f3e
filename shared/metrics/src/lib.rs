//! The process's Prometheus registry: counters, gauges and histograms with labels, rendered as
//! the text exposition format (0.0.4). Every crate that counts something (the runtime, the LLM
//! provider, the executors) records here; the runtime serves `render()` at `/metrics`.
//!
//! Families are `static` definitions (name, help, label names), so names and help live next
//! to the code that records them. Cardinality is bounded: a family keeps at most
//! [`MAX_SERIES`] label sets and drops new ones past that (never run ids in labels).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{LazyLock, Mutex, MutexGuard};

/// Label sets one family keeps; new ones past this are dropped.
pub const MAX_SERIES: usize = 512;

/// Upper bounds of latency buckets, in seconds (a millisecond to a minute).
pub const LATENCY_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Upper bounds for waits measured in minutes and hours (approval decisions).
pub const WAIT_BUCKETS: &[f64] = &[1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14_400.0, 86_400.0];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric family: its name, help text, label names and kind.
pub struct Family {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
    kind: Kind,
    buckets: &'static [f64],
}

/// A counter family (`_total` in its name).
pub struct Counter(Family);
/// A gauge family.
pub struct Gauge(Family);
/// A histogram family with fixed buckets.
pub struct Histogram(Family);

#[derive(Default)]
struct Series {
    value: f64,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Default)]
struct Store {
    /// name -> (family, label values -> series)
    families: BTreeMap<&'static str, (&'static Family, BTreeMap<Vec<String>, Series>)>,
}

static STORE: LazyLock<Mutex<Store>> = LazyLock::new(Default::default);

fn store() -> MutexGuard<'static, Store> {
    STORE.lock().unwrap_or_else(|p| p.into_inner())
}

impl Family {
    fn with<R>(&'static self, values: &[&str], f: impl FnOnce(&mut Series) -> R) -> Option<R> {
        debug_assert_eq!(values.len(), self.labels.len(), "{}: label values do not match", self.name);
        let mut s = store();
        let (_, series) = s.families.entry(self.name).or_insert_with(|| (self, BTreeMap::new()));
        // Look up by borrowed values first: the common case allocates nothing.
        if let Some((_, found)) =
            series.iter_mut().find(|(k, _)| k.iter().map(String::as_str).eq(values.iter().copied()))
        {
            return Some(f(found));
        }
        if series.len() >= MAX_SERIES {
            return None;
        }
        let key: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        Some(f(series.entry(key).or_default()))
    }
}

impl Counter {
    pub const fn new(name: &'static str, help: &'static str, labels: &'static [&'static str]) -> Self {
        Counter(Family { name, help, labels, kind: Kind::Counter, buckets: &[] })
    }

    /// Add `n` to the series of `values` (one per label name, in order).
    pub fn add(&'static self, values: &[&str], n: f64) {
        self.0.with(values, |s| s.value += n);
    }

    pub fn inc(&'static self, values: &[&str]) {
        self.add(values, 1.0);
    }

    /// The current value (tests and `pitcrew top`).
    pub fn get(&'static self, values: &[&str]) -> f64 {
        self.0.with(values, |s| s.value).unwrap_or(0.0)
    }
}

impl Gauge {
    pub const fn new(name: &'static str, help: &'static str, labels: &'static [&'static str]) -> Self {
        Gauge(Family { name, help, labels, kind: Kind::Gauge, buckets: &[] })
    }

    pub fn set(&'static self, values: &[&str], v: f64) {
        self.0.with(values, |s| s.value = v);
    }

    pub fn add(&'static self, values: &[&str], n: f64) {
        self.0.with(values, |s| s.value += n);
    }

    pub fn get(&'static self, values: &[&str]) -> f64 {
        self.0.with(values, |s| s.value).unwrap_or(0.0)
    }
}

impl Histogram {
    pub const fn new(
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
        buckets: &'static [f64],
    ) -> Self {
        Histogram(Family { name, help, labels, kind: Kind::Histogram, buckets })
    }

    /// Record one observation (seconds, for the latency families).
    pub fn observe(&'static self, values: &[&str], v: f64) {
        let buckets = self.0.buckets;
        self.0.with(values, |s| {
            if s.counts.is_empty() {
                s.counts = vec![0; buckets.len()];
            }
            for (i, le) in buckets.iter().enumerate() {
                if v <= *le {
                    s.counts[i] += 1;
                }
            }
            s.sum += v;
            s.count += 1;
        });
    }

    /// Observations recorded so far.
    pub fn count(&'static self, values: &[&str]) -> u64 {
        self.0.with(values, |s| s.count).unwrap_or(0)
    }
}

/// A label value as the text format needs it: `\`, `"` and newlines escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn labels(names: &[&str], values: &[String], extra: Option<(&str, &str)>) -> String {
    let mut parts: Vec<String> = names.iter().zip(values).map(|(n, v)| format!("{n}=\"{}\"", escape(v))).collect();
    if let Some((n, v)) = extra {
        parts.push(format!("{n}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

/// Every family recorded so far, in the Prometheus text exposition format (0.0.4).
pub fn render() -> String {
    let s = store();
    let mut out = String::new();
    for (name, (family, series)) in &s.families {
        let _ = writeln!(out, "# HELP {name} {}", family.help);
        let _ = writeln!(out, "# TYPE {name} {}", family.kind.as_str());
        for (values, v) in series {
            match family.kind {
                Kind::Counter | Kind::Gauge => {
                    let _ = writeln!(out, "{name}{} {}", labels(family.labels, values, None), v.value);
                }
                Kind::Histogram => {
                    let counts = v.counts.iter().copied().chain(std::iter::repeat(0));
                    for (le, n) in family.buckets.iter().zip(counts) {
                        let l = labels(family.labels, values, Some(("le", &le.to_string())));
                        let _ = writeln!(out, "{name}_bucket{l} {n}");
                    }
                    let l = labels(family.labels, values, Some(("le", "+Inf")));
                    let _ = writeln!(out, "{name}_bucket{l} {}", v.count);
                    let l = labels(family.labels, values, None);
                    let _ = writeln!(out, "{name}_sum{l} {}", v.sum);
                    let _ = writeln!(out, "{name}_count{l} {}", v.count);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    static C: Counter = Counter::new("t_things_total", "Things.", &["kind"]);
    static H: Histogram = Histogram::new("t_wait_seconds", "Waits.", &["stage"], &[0.1, 1.0]);
    static G: Gauge = Gauge::new("t_level", "Level.", &[]);

    #[test]
    fn renders_families_with_escaped_labels_and_cumulative_buckets() {
        C.inc(&["a\"b"]);
        C.add(&["x"], 2.0);
        H.observe(&["s"], 0.05);
        H.observe(&["s"], 0.5);
        G.set(&[], 3.0);
        let text = render();
        assert!(text.contains("# TYPE t_things_total counter\n"), "{text}");
        assert!(text.contains("t_things_total{kind=\"a\\\"b\"} 1\n"), "{text}");
        assert!(text.contains("t_things_total{kind=\"x\"} 2\n"), "{text}");
        assert!(text.contains("t_wait_seconds_bucket{stage=\"s\",le=\"0.1\"} 1\n"), "{text}");
        assert!(text.contains("t_wait_seconds_bucket{stage=\"s\",le=\"1\"} 2\n"), "{text}");
        assert!(text.contains("t_wait_seconds_bucket{stage=\"s\",le=\"+Inf\"} 2\n"), "{text}");
        assert!(text.contains("t_wait_seconds_count{stage=\"s\"} 2\n"), "{text}");
        assert!(text.contains("t_level 3\n"), "{text}");
        assert_eq!(C.get(&["x"]), 2.0);
    }

    #[test]
    fn series_per_family_are_bounded() {
        static B: Counter = Counter::new("t_bounded_total", "Bounded.", &["id"]);
        for i in 0..MAX_SERIES + 10 {
            B.inc(&[&i.to_string()]);
        }
        let n = render().lines().filter(|l| l.starts_with("t_bounded_total{")).count();
        assert_eq!(n, MAX_SERIES);
    }
}
