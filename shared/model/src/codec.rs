//! The wire codec: MessagePack between stages, JSON accepted from the outside.

use serde::{de::DeserializeOwned, Serialize};

/// Header that says how a payload is encoded.
pub const CONTENT_TYPE: &str = "Content-Type";
pub const MSGPACK: &str = "application/msgpack";
pub const JSON: &str = "application/json";
/// Largest payload any pitcrew subject accepts.
pub const MAX_PAYLOAD: usize = 256 * 1024;

/// Why a payload could not be read. Always poison: retrying will not help.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("payload is {0} bytes, more than the {MAX_PAYLOAD} allowed")]
    TooLarge(usize),
    #[error("payload is empty")]
    Empty,
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("invalid MessagePack: {0}")]
    Msgpack(#[from] rmp_serde::decode::Error),
    #[error("unsupported Content-Type '{0}' (use {JSON} or {MSGPACK})")]
    ContentType(String),
}

/// Encode as MessagePack with field names (readers tolerate added fields).
pub fn to_msgpack<T: Serialize>(value: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(value).expect("pitcrew types always serialise to MessagePack")
}

/// Decode by Content-Type; without one, JSON if it starts with `{`, else MessagePack.
pub fn decode<T: DeserializeOwned>(content_type: Option<&str>, payload: &[u8]) -> Result<T, DecodeError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let first = payload.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_none() {
        return Err(DecodeError::Empty);
    }
    let ct = content_type.map(|c| c.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
    match ct.as_deref() {
        Some(JSON) | Some("text/json") => Ok(serde_json::from_slice(payload)?),
        Some(MSGPACK) | Some("application/x-msgpack") => Ok(rmp_serde::from_slice(payload)?),
        Some("") | None => {
            if first == Some(&b'{') {
                Ok(serde_json::from_slice(payload)?)
            } else {
                Ok(rmp_serde::from_slice(payload)?)
            }
        }
        Some(other) => Err(DecodeError::ContentType(other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Incident, RunState};

    #[test]
    fn run_state_round_trips_through_msgpack() {
        let s = RunState::new(uuid::Uuid::now_v7(), Incident::new("web", "down"));
        let bytes = to_msgpack(&s);
        let back: RunState = decode(Some(MSGPACK), &bytes).unwrap();
        assert_eq!(back, s);
        let sniffed: RunState = decode(None, &bytes).unwrap();
        assert_eq!(sniffed, s);
    }

    #[test]
    fn json_incident_is_accepted_and_errors_are_precise() {
        let i: Incident = decode(None, br#" {"service":"web","error":"down"}"#).unwrap();
        assert_eq!(i.service, "web");
        let e = decode::<Incident>(Some(JSON), br#"{"service":"web""#).unwrap_err();
        assert!(e.to_string().starts_with("invalid JSON"), "{e}");
        let e = decode::<Incident>(Some("text/plain"), b"x").unwrap_err();
        assert!(e.to_string().contains("text/plain"));
        assert!(matches!(decode::<Incident>(None, b"  "), Err(DecodeError::Empty)));
        let big = vec![b' '; MAX_PAYLOAD + 1];
        assert!(matches!(decode::<Incident>(None, &big), Err(DecodeError::TooLarge(_))));
    }
}
