//! The steady state of a batch run with `--in-flight N`: when N runs were in flight, how fast
//! they ended, and how many really were in flight.

use chrono::{DateTime, Utc};

type At = DateTime<Utc>;

/// The window of the steady state, with `n` runs kept in flight: from the end at index n of
/// the sorted `ends` (the (n+1)-th: the first after n ends) or the one at index len / 10,
/// whichever comes later, to the last publish or the end at index len * 9 / 10, whichever
/// comes first (indexes rounded down). Until the first n have ended, the first n runs,
/// published together, are on their first pass: nothing ends for a while, then their ends
/// come in a clump, faster than the crew keeps up once runs arrive at its own pace. After the
/// last publish comes the drain: fewer than n in flight. `rate` counts the ends after the
/// window's start up to its end.
pub fn window(ends: &[At], n: usize, last_publish: Option<At>) -> Option<(At, At)> {
    let a = *ends.get((ends.len() / 10).max(n))?;
    let b = *ends.get(ends.len() * 9 / 10)?;
    let b = last_publish.map_or(b, |p| p.min(b));
    (b > a).then_some((a, b))
}

/// Runs a second that ended within `(a, b]` (unrounded: what is computed from it, `reached`,
/// must not inherit a rounding that matters at low rates; printed to one decimal).
pub fn rate(ends: &[At], (a, b): (At, At)) -> f64 {
    let secs = (b - a).num_microseconds().unwrap_or(0) as f64 / 1e6;
    let n = ends.iter().filter(|e| **e > a && **e <= b).count();
    n as f64 / secs
}

/// The mean number of runs in flight over the window, each from its publish to its end
/// (time-weighted), to one decimal. A run with no end (timed out, or its end not seen) is in
/// flight from its publish to the window's end.
pub fn mean_in_flight(runs: impl Iterator<Item = (At, Option<At>)>, (a, b): (At, At)) -> f64 {
    let span = (b - a).num_microseconds().unwrap_or(1).max(1) as f64;
    let held: f64 = runs
        .map(|(start, end)| (start.max(a), end.unwrap_or(b).min(b)))
        .filter(|(s, e)| e > s)
        .map(|(s, e)| (e - s).num_microseconds().unwrap_or(0) as f64)
        .sum();
    (held / span * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> At {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap()
    }

    /// Two runs in flight, each 100 ms, refilled at once: 20 a second. Publishing stops at
    /// 1 s; the drain's six ends come slowly after it.
    fn batch() -> (Vec<(At, At)>, At) {
        let mut runs = Vec::new();
        for slot in 0..2 {
            for k in 0..10 {
                runs.push((t(slot * 50 + k * 100), t(slot * 50 + (k + 1) * 100)));
            }
        }
        for k in 1..=6 {
            runs.push((t(1000), t(1000 + k * 200)));
        }
        (runs, t(1000))
    }

    #[test]
    fn the_window_stops_where_the_drain_begins() {
        let (runs, last) = batch();
        let mut ends: Vec<At> = runs.iter().map(|r| r.1).collect();
        ends.sort();
        let w = window(&ends, 2, Some(last)).unwrap();
        assert_eq!(w.1, last, "the slow ends after the last publish are left out");
        assert!((rate(&ends, w) - 20.0).abs() < 1e-9, "{}", rate(&ends, w));
        assert_eq!(mean_in_flight(runs.iter().map(|(s, e)| (*s, Some(*e))), w), 2.0);
        // Without the cut the drain's slow ends drag the rate down.
        let whole = window(&ends, 2, None).unwrap();
        assert!(rate(&ends, whole) < 20.0);
    }

    #[test]
    fn the_window_starts_once_the_first_runs_have_ended() {
        // Twenty runs published at once end together at 95-99 ms; then one ends every 10 ms.
        let mut ends: Vec<At> = (0..20).map(|k| t(95 + k % 5)).collect();
        ends.sort();
        ends.extend((1..=100).map(|k| t(100 + k * 10)));
        let w = window(&ends, 20, None).unwrap();
        assert_eq!(w.0, t(110), "the (n+1)-th end, the first past the clump of the first n");
        assert!((rate(&ends, w) - 100.0).abs() < 1e-9, "{}", rate(&ends, w));
        // From the 10th percentile alone, part of the clump counts: a rate the crew never kept.
        assert!(rate(&ends, window(&ends, 0, None).unwrap()) > 100.0);
    }

    #[test]
    fn a_publisher_that_lags_shows_fewer_in_flight() {
        // One slot refilled only 100 ms after each end.
        let runs: Vec<(At, At)> = (0..10).map(|k| (t(k * 200), t(k * 200 + 100))).collect();
        let w = (t(0), t(2000));
        assert_eq!(mean_in_flight(runs.into_iter().map(|(s, e)| (s, Some(e))), w), 0.5);
        assert!(window(&[t(0)], 1, None).is_none(), "one end makes no window");
    }

    #[test]
    fn a_run_that_never_ends_is_in_flight_to_the_windows_end() {
        // One run ends at 500 ms; the other, published at 250 ms, never does.
        let runs = [(t(0), Some(t(500))), (t(250), None)];
        let w = (t(0), t(1000));
        assert_eq!(mean_in_flight(runs.into_iter(), w), 1.3, "0.5 of the window and 0.75 of it");
    }
}
