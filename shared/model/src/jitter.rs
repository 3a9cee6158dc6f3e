//! Waits spread at random over a range, so the many messages or calls that failed together
//! (a Postgres restart, a NATS outage, a model endpoint's 503 to a thousand runs at once) do
//! not all come back in the same instant and fail together again.

use std::time::Duration;

/// The share of a wait it is spread over.
const SPREAD: f64 = 0.2;

/// `d` shortened by up to a fifth: a backoff of our own, never longer than computed (its cap
/// holds).
pub fn within(d: Duration) -> Duration {
    d.mul_f64(1.0 - SPREAD * unit())
}

/// `d` lengthened by up to a fifth of itself, or of a second when shorter: a wait another
/// party asked for (`Retry-After`), never shorter (`0`, at once, is spread over 200 ms).
pub fn at_least(d: Duration) -> Duration {
    d + d.max(Duration::from_secs(1)).mul_f64(SPREAD * unit())
}

/// A random number in [0, 1): 53 of the 62 random bits in a v4 UUID's low half (its top two
/// are the variant's, always `10`).
fn unit() -> f64 {
    let random = uuid::Uuid::new_v4().as_u128() as u64 & ((1 << 62) - 1);
    (random >> 9) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_spread_within_their_bounds() {
        let d = Duration::from_millis(1000);
        let shorter: Vec<Duration> = (0..200).map(|_| within(d)).collect();
        let longer: Vec<Duration> = (0..200).map(|_| at_least(d)).collect();
        assert!(shorter.iter().all(|w| *w > Duration::from_millis(799) && *w <= d), "{shorter:?}");
        assert!(longer.iter().all(|w| *w >= d && *w < Duration::from_millis(1201)), "{longer:?}");
        for waits in [shorter, longer] {
            let mut ms: Vec<u128> = waits.iter().map(|w| w.as_millis()).collect();
            ms.sort_unstable();
            ms.dedup();
            assert!(ms.len() > 50, "spread, not one value: {ms:?}");
            // Over the whole range (200 uniform draws miss a tenth of it once in 10^9).
            let (low, high) = (ms[0], ms[ms.len() - 1]);
            assert!(high - low >= 160, "{low}..{high}");
        }
        assert_eq!(within(Duration::ZERO), Duration::ZERO);
        let at_once: Vec<Duration> = (0..200).map(|_| at_least(Duration::ZERO)).collect();
        assert!(at_once.iter().all(|w| *w < Duration::from_millis(200)), "{at_once:?}");
        assert!(at_once.iter().any(|w| *w > Duration::from_millis(100)), "spread: {at_once:?}");
    }
}
