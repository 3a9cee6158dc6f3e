//! Slack's request signature: `X-Slack-Signature: v0=<hex HMAC-SHA256(signing secret,
//! "v0:" + X-Slack-Request-Timestamp + ":" + raw body)>`, compared in constant time, with
//! timestamps more than five minutes away refused as replays.

use crate::secret::Secret;
use ring::hmac;

/// A signed request older (or newer) than this is refused: Slack's own recommendation.
pub const MAX_SKEW_SECS: i64 = 300;

/// Why a callback is not believed to come from Slack. Answered with 401 and this text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("missing X-Slack-Request-Timestamp: not a signed request from Slack")]
    MissingTimestamp,
    #[error("missing X-Slack-Signature: not a signed request from Slack")]
    MissingSignature,
    #[error("X-Slack-Request-Timestamp '{0}' is not a time in seconds")]
    BadTimestamp(String),
    #[error(
        "request timestamp is {0} s away from now (more than {MAX_SKEW_SECS} s): refused as a possible replay \
         (or this host's clock is wrong)"
    )]
    Stale(i64),
    #[error("bad signature: X-Slack-Signature does not match the body signed with the signing secret")]
    BadSignature,
}

/// `v0=<hex>` for `body` sent at `timestamp`.
pub fn sign(secret: &Secret, timestamp: &str, body: &[u8]) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret.expose().as_bytes());
    let tag = hmac::sign(&key, &base_string(timestamp, body));
    format!("v0={}", hex::encode(tag.as_ref()))
}

/// Accept a request only if its timestamp is within [`MAX_SKEW_SECS`] of `now` (Unix
/// seconds) and its signature is the body's, checked in constant time.
pub fn verify(
    secret: &Secret,
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now: i64,
) -> Result<(), Refused> {
    let timestamp = timestamp.ok_or(Refused::MissingTimestamp)?.trim();
    let signature = signature.ok_or(Refused::MissingSignature)?.trim();
    let ts: i64 = timestamp.parse().map_err(|_| Refused::BadTimestamp(timestamp.chars().take(32).collect()))?;
    let skew = now.saturating_sub(ts);
    if skew.abs() > MAX_SKEW_SECS {
        return Err(Refused::Stale(skew));
    }
    let tag = signature.strip_prefix("v0=").and_then(|h| hex::decode(h).ok()).ok_or(Refused::BadSignature)?;
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret.expose().as_bytes());
    hmac::verify(&key, &base_string(timestamp, body), &tag).map_err(|_| Refused::BadSignature)
}

fn base_string(timestamp: &str, body: &[u8]) -> Vec<u8> {
    let mut base = Vec::with_capacity(timestamp.len() + body.len() + 4);
    base.extend_from_slice(b"v0:");
    base.extend_from_slice(timestamp.as_bytes());
    base.push(b':');
    base.extend_from_slice(body);
    base
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        // RFC 4231 test case 2, through the same primitive.
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"Jefe");
        let tag = hmac::sign(&key, b"what do ya want for nothing?");
        assert_eq!(hex::encode(tag.as_ref()), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn only_a_fresh_request_signed_with_the_secret_passes() {
        let secret = Secret::new("8f742231b10e8888abcd99yyyzzz85a5");
        let body = b"payload=%7B%22type%22%3A%22block_actions%22%7D";
        let now = 1_700_000_000;
        let ts = now.to_string();
        let sig = sign(&secret, &ts, body);
        assert!(sig.starts_with("v0=") && sig.len() == 67, "{sig}");
        assert_eq!(verify(&secret, Some(&ts), Some(&sig), body, now), Ok(()));
        assert_eq!(verify(&secret, Some(&ts), Some(&sig), body, now + 300), Ok(()));
        assert_eq!(verify(&secret, Some(&ts), Some(&sig), body, now + 301), Err(Refused::Stale(301)));
        assert_eq!(verify(&secret, Some(&ts), Some(&sig), body, now - 301), Err(Refused::Stale(-301)));
        let mut tampered = body.to_vec();
        tampered[10] ^= 1;
        assert_eq!(verify(&secret, Some(&ts), Some(&sig), &tampered, now), Err(Refused::BadSignature));
        let other = sign(&Secret::new("another secret"), &ts, body);
        assert_eq!(verify(&secret, Some(&ts), Some(&other), body, now), Err(Refused::BadSignature));
        // The timestamp is signed too: moving it forward breaks the signature.
        let later = (now + 10).to_string();
        assert_eq!(verify(&secret, Some(&later), Some(&sig), body, now), Err(Refused::BadSignature));
        assert_eq!(verify(&secret, Some(&ts), Some("v0=zz"), body, now), Err(Refused::BadSignature));
        assert_eq!(verify(&secret, Some(&ts), Some(&sig[3..]), body, now), Err(Refused::BadSignature));
        assert_eq!(verify(&secret, None, Some(&sig), body, now), Err(Refused::MissingTimestamp));
        assert_eq!(verify(&secret, Some(&ts), None, body, now), Err(Refused::MissingSignature));
        assert!(matches!(verify(&secret, Some("soon"), Some(&sig), body, now), Err(Refused::BadTimestamp(_))));
    }
}
