//! The HTTP `Retry-After` header (RFC 9110 §10.2.3), read once for every client of an external
//! API (the model endpoints, the chat APIs): seconds, or an IMF-fixdate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long `value` asks the client to wait, counted from `now`: a number of seconds, or a
/// date (one already past means at once). None for anything else, so the caller falls back
/// on its own backoff. Callers cap the answer: a server may ask for a day.
pub fn parse(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    match value.parse::<f64>() {
        Ok(secs) if secs >= 0.0 && secs.is_finite() => Some(Duration::try_from_secs_f64(secs).ok()?),
        Ok(_) => None,
        Err(_) => Some(httpdate(value)?.duration_since(now).unwrap_or(Duration::ZERO)),
    }
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
fn httpdate(v: &str) -> Option<SystemTime> {
    let parts: Vec<&str> = v.split_whitespace().collect();
    let [_, day, mon, year, time, "GMT"] = parts.as_slice() else { return None };
    let months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let m = months.iter().position(|x| x == mon)? as i64 + 1;
    let (d, y): (i64, i64) = (day.parse().ok()?, year.parse().ok()?);
    let hms: Vec<i64> = time.split(':').map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let [h, mi, s] = hms.as_slice() else { return None };
    // A real date's fields: anything else is not a date (and could overflow the sums below).
    if !(1..=31).contains(&d)
        || !(1970..=9999).contains(&y)
        || !(0..24).contains(h)
        || !(0..60).contains(mi)
        || !(0..=60).contains(s)
    {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let (y2, m2) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * m2 + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    let secs = days * 86400 + h * 3600 + mi * 60 + s;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_and_dates_are_read_and_anything_else_is_not() {
        let now = UNIX_EPOCH + Duration::from_secs(784111777);
        assert_eq!(parse(" 2 ", now), Some(Duration::from_secs(2)));
        assert_eq!(parse("0.5", now), Some(Duration::from_millis(500)));
        assert_eq!(parse("Sun, 06 Nov 1994 08:49:37 GMT", now), Some(Duration::ZERO));
        assert_eq!(parse("Sun, 06 Nov 1994 08:50:07 GMT", now), Some(Duration::from_secs(30)));
        assert_eq!(parse("Sun, 06 Nov 1994 08:00:00 GMT", now), Some(Duration::ZERO), "a date past: at once");
        for bad in [
            "soon",
            "-1",
            "NaN",
            "inf",
            "1e400",
            "",
            "Sun, 06 Nov 1994 08:49:37 PST",
            "Sun, 06 Nov 9999999999999999 08:49:37 GMT",
            "Sun, 06 Nov 1994 99999999999999999:49:37 GMT",
            "Sun, 99999999999999 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(parse(bad, now), None, "{bad:?}");
        }
    }
}
