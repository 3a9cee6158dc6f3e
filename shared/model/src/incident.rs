//! The incident: what an alerting system publishes on `pitcrew.incidents.new`.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use uuid::Uuid;

/// Longest accepted service or host name.
pub const MAX_NAME_LEN: usize = 128;
/// Longest accepted error text.
pub const MAX_ERROR_LEN: usize = 4096;
/// Longest error signature ([`error_signature`]) in bytes. Episodic memory's indexes hold the
/// signature, and a btree entry must fit in about a third of a Postgres page (2704 bytes): an
/// error of 4096 bytes that does not compress (another alphabet, a blob of letters) would have
/// every episode of its run refused, and its verify and escalate steps with them.
pub const MAX_SIGNATURE_LEN: usize = 1024;
/// Most labels an incident may carry.
pub const MAX_LABELS: usize = 64;
/// Longest label key or value.
pub const MAX_LABEL_LEN: usize = 256;

/// How bad the alert says it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Info,
    #[default]
    Warning,
    Critical,
}

/// An alert turned incident. Only `service` and `error` are required; intake fills the rest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Incident {
    /// Also the run id. Publishers may set it (to watch the run); intake derives one otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<Uuid>,
    /// The service that is failing, as named in the inventory.
    pub service: String,
    /// The host it runs on, when the alert knows: if given, the service's own host (the
    /// run escalates when it names another: every stage acts on the service's host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// What is wrong, in the alerting system's words.
    pub error: String,
    #[serde(default)]
    pub severity: Severity,
    /// Who raised it: `alertmanager`, `monitor`, `cli`, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// One open run per fingerprint. Defaults to a hash of service, host and error signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// When the alerting system saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_at: Option<DateTime<Utc>>,
}

/// Why an incident was refused. Each message names the field and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IncidentError {
    #[error("field 'service' is empty")]
    EmptyService,
    #[error("field 'service' must be 1-{MAX_NAME_LEN} characters of [A-Za-z0-9._-], got '{0}'")]
    BadService(String),
    #[error("field 'host' must be 1-{MAX_NAME_LEN} characters of [A-Za-z0-9._:-], got '{0}'")]
    BadHost(String),
    #[error("field 'error' is empty")]
    EmptyError,
    #[error("field 'error' is {0} bytes, more than the {MAX_ERROR_LEN} allowed")]
    ErrorTooLong(usize),
    #[error("{0} labels, more than the {MAX_LABELS} allowed")]
    TooManyLabels(usize),
    #[error("label '{0}' is longer than {MAX_LABEL_LEN} bytes")]
    LabelTooLong(String),
    #[error("field 'fingerprint' must be 1-{MAX_NAME_LEN} bytes")]
    BadFingerprint,
    #[error("field 'source' is {0} bytes, more than the {MAX_LABEL_LEN} allowed")]
    SourceTooLong(usize),
    #[error("field 'observed_at' must fall in the years 1-9999, got {0}")]
    ObservedOutOfRange(String),
}

/// Whether Postgres keeps `at` as it is (its range starts in 4714 BC, chrono's earlier): the
/// years 1 to 9999, what an incident's time or a query's bound may be.
pub fn storable_time(at: &DateTime<Utc>) -> bool {
    (1..=9999).contains(&chrono::Datelike::year(at))
}

/// Whether `name` may name a service: what an incident for it must carry (1-128 characters of
/// `[A-Za-z0-9._-]`), so an inventory's service names are checked the same way.
pub fn valid_service_name(name: &str) -> bool {
    valid_name(name, &[])
}

fn valid_name(s: &str, extra: &[char]) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME_LEN
        && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c) || extra.contains(&c))
}

/// A label's value as an incident keeps it: redacted (`db_password: hunter2` shows no secret
/// in its value alone: a secret-named label's value is replaced whole) and storable (no NUL).
pub fn kept_label_value(key: &str, value: &str) -> String {
    if crate::redact::secret_name(key) && !value.is_empty() {
        crate::redact::MARK.into()
    } else {
        crate::trim::storable(crate::redact::redact(value).into_owned())
    }
}

impl Incident {
    /// A new incident for `service` with a fresh id.
    pub fn new(service: impl Into<String>, error: impl Into<String>) -> Self {
        Incident {
            id: Some(Uuid::now_v7()),
            service: service.into(),
            host: None,
            error: error.into(),
            severity: Severity::Warning,
            source: None,
            fingerprint: None,
            labels: BTreeMap::new(),
            observed_at: None,
        }
    }

    /// Check every bound and name; trims surrounding whitespace first.
    pub fn validate(&mut self) -> Result<(), IncidentError> {
        self.service = self.service.trim().to_string();
        // An alert may quote a secret; nothing downstream keeps it. Nor a NUL (Postgres
        // refuses it: the incident would never be stored).
        self.error = crate::trim::storable(crate::redact::redact(self.error.trim()).into_owned());
        if self.labels.keys().any(|k| k.contains('\0')) {
            self.labels =
                std::mem::take(&mut self.labels).into_iter().map(|(k, v)| (crate::trim::storable(k), v)).collect();
        }
        for (k, v) in self.labels.iter_mut() {
            *v = kept_label_value(k, v);
        }
        self.fingerprint = self.fingerprint.take().map(crate::trim::storable);
        self.source = self.source.take().map(|s| crate::trim::storable(crate::redact::redact(s.trim()).into_owned()));
        if self.service.is_empty() {
            return Err(IncidentError::EmptyService);
        }
        if !valid_name(&self.service, &[]) {
            return Err(IncidentError::BadService(crate::trim::storable(crate::trim::clip(&self.service, 64))));
        }
        if let Some(h) = &self.host {
            if !valid_name(h, &[':']) {
                return Err(IncidentError::BadHost(crate::trim::storable(crate::trim::clip(h, 64))));
            }
        }
        if self.error.is_empty() {
            return Err(IncidentError::EmptyError);
        }
        if self.error.len() > MAX_ERROR_LEN {
            return Err(IncidentError::ErrorTooLong(self.error.len()));
        }
        if self.labels.len() > MAX_LABELS {
            return Err(IncidentError::TooManyLabels(self.labels.len()));
        }
        if let Some((k, _)) = self.labels.iter().find(|(k, v)| k.len() > MAX_LABEL_LEN || v.len() > MAX_LABEL_LEN) {
            return Err(IncidentError::LabelTooLong(crate::trim::clip(k, 64)));
        }
        if let Some(f) = &self.fingerprint {
            if f.is_empty() || f.len() > MAX_NAME_LEN {
                return Err(IncidentError::BadFingerprint);
            }
        }
        // Postgres keeps no time chrono can read (its range starts in 4714 BC): refused here,
        // not accepted and then refused by the store, where it could never open a run.
        if let Some(at) = self.observed_at {
            if !storable_time(&at) {
                return Err(IncidentError::ObservedOutOfRange(at.to_rfc3339()));
            }
        }
        // Carried in every run state and stored with the incident: a name, not a document.
        if let Some(source) = &self.source {
            if source.len() > MAX_LABEL_LEN {
                return Err(IncidentError::SourceTooLong(source.len()));
            }
        }
        Ok(())
    }

    /// The error with numbers and hex ids masked (see [`error_signature`]): "refused on :8080"
    /// and "refused on :9090" are the same problem for episodic memory.
    pub fn signature(&self) -> String {
        error_signature(&self.error)
    }

    /// The explicit fingerprint, or a hash of service, host and error signature.
    pub fn effective_fingerprint(&self) -> String {
        if let Some(f) = &self.fingerprint {
            return f.clone();
        }
        let mut h = Sha256::new();
        h.update(self.service.as_bytes());
        h.update([0]);
        h.update(self.host.as_deref().unwrap_or("").as_bytes());
        h.update([0]);
        // The whole normalised error, not the signature's capped form: a long error's
        // fingerprint stays what it was before signatures were capped, so an incident joins
        // the run an earlier build opened for it.
        h.update(normalised(&self.error).as_bytes());
        hex::encode(&h.finalize()[..16])
    }
}

/// Lowercase, numbers and hex ids masked as `#`, whitespace collapsed. A hex id is a word of
/// at least four hex digits with a digit among them (`3f2a9bc1d0e4`, each part of a UUID,
/// `0x7ffd5a`), so a request or container id in an alert does not make every alert a new
/// problem; a word of letters alone (`dead`, `cafe`) is kept.
pub fn error_signature(error: &str) -> String {
    capped(&normalised(error))
}

/// The error lowercased, numbers and hex ids masked, whitespace collapsed: the signature
/// before its cap.
fn normalised(error: &str) -> String {
    let mut out = String::with_capacity(error.len());
    let mut last_space = false;
    let mut last_hash = false;
    let hash = |out: &mut String, last_hash: &mut bool| {
        if !*last_hash {
            out.push('#');
        }
        *last_hash = true;
    };
    let mut rest = error;
    while let Some(c) = rest.chars().next() {
        if c.is_ascii_alphanumeric() {
            let word_len = rest.find(|c: char| !c.is_ascii_alphanumeric()).unwrap_or(rest.len());
            let (word, after) = rest.split_at(word_len);
            rest = after;
            last_space = false;
            let digits = word.strip_prefix("0x").or_else(|| word.strip_prefix("0X")).filter(|h| !h.is_empty());
            let hex_id = match digits {
                Some(h) => h.chars().all(|c| c.is_ascii_hexdigit()),
                None => {
                    word.len() >= 4
                        && word.chars().all(|c| c.is_ascii_hexdigit())
                        && word.chars().any(|c| c.is_ascii_digit())
                }
            };
            if hex_id {
                hash(&mut out, &mut last_hash);
                continue;
            }
            for c in word.chars() {
                if c.is_ascii_digit() {
                    hash(&mut out, &mut last_hash);
                } else {
                    out.push(c.to_ascii_lowercase());
                    last_hash = false;
                }
            }
            continue;
        }
        rest = &rest[c.len_utf8()..];
        if c.is_whitespace() {
            if !last_space {
                out.push(' ');
            }
            last_space = true;
            last_hash = false;
        } else {
            out.extend(c.to_lowercase());
            last_space = false;
            last_hash = false;
        }
    }
    out.trim().to_string()
}

/// A signature past [`MAX_SIGNATURE_LEN`]: its start, then ` ~` and a hash of the whole, so
/// two long errors that differ only past the cut stay two problems.
fn capped(signature: &str) -> String {
    if signature.len() <= MAX_SIGNATURE_LEN {
        return signature.to_string();
    }
    let digest = hex::encode(&Sha256::digest(signature.as_bytes())[..8]);
    let mut keep = MAX_SIGNATURE_LEN - digest.len() - 2;
    while !signature.is_char_boundary(keep) {
        keep -= 1;
    }
    format!("{} ~{digest}", &signature[..keep])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        let mut i = Incident::new("", "x");
        assert_eq!(i.validate(), Err(IncidentError::EmptyService));
        let mut i = Incident::new("web; rm -rf /", "x");
        assert!(matches!(i.validate(), Err(IncidentError::BadService(_))));
        let mut i = Incident::new("web", "  ");
        assert_eq!(i.validate(), Err(IncidentError::EmptyError));
        let mut i = Incident::new("web", "e".repeat(MAX_ERROR_LEN + 1));
        assert!(matches!(i.validate(), Err(IncidentError::ErrorTooLong(_))));
        let mut i = Incident::new("web", "down");
        i.observed_at = Some("-5000-01-01T00:00:00Z".parse().unwrap());
        assert!(matches!(i.validate(), Err(IncidentError::ObservedOutOfRange(_))), "Postgres cannot keep it");
        i.observed_at = Some("9999-12-31T23:59:59Z".parse().unwrap());
        i.validate().unwrap();
        let mut i = Incident::new(" web ", " refused ");
        i.validate().unwrap();
        assert_eq!((i.service.as_str(), i.error.as_str()), ("web", "refused"));
    }

    #[test]
    fn secrets_in_labels_and_source_are_not_kept_and_the_source_is_bounded() {
        let mut i = Incident::new("web", "down");
        i.labels.insert("db_password".into(), "hunter2".into());
        i.labels.insert("dsn".into(), "postgres://app:pa55@db/app".into());
        i.labels.insert("team".into(), "payments".into());
        i.source = Some(" probe?token=abc123 ".into());
        i.validate().unwrap();
        assert_eq!(i.labels["db_password"], "[REDACTED]", "a secret by its name");
        assert_eq!(i.labels["dsn"], "postgres://app:[REDACTED]@db/app");
        assert_eq!(i.labels["team"], "payments");
        assert_eq!(i.source.as_deref(), Some("probe?token=[REDACTED]"));
        let mut i = Incident::new("web", "down");
        i.source = Some("s".repeat(200 * 1024));
        assert_eq!(i.validate(), Err(IncidentError::SourceTooLong(200 * 1024)));
    }

    #[test]
    fn fingerprint_ignores_numbers_but_not_service() {
        let a = Incident::new("web", "connect to 127.0.0.1:8080 refused");
        let b = Incident::new("web", "connect to 127.0.0.1:9191 refused");
        let c = Incident::new("db", "connect to 127.0.0.1:8080 refused");
        assert_eq!(a.effective_fingerprint(), b.effective_fingerprint());
        assert_ne!(a.effective_fingerprint(), c.effective_fingerprint());
        assert_eq!(a.signature(), "connect to #.#.#.#:# refused");
    }

    #[test]
    fn hex_ids_are_masked_and_words_are_not() {
        for (a, b) in [
            ("container 3f2a9bc1d0e4 exited", "container 9e0b7c55aa01 exited"),
            (
                "request 550e8400-e29b-41d4-a716-446655440000 failed",
                "request 6ba7b810-9dad-11d1-80b4-00c04fd430c8 failed",
            ),
            ("segfault at 0x7ffd5a", "segfault at 0xdeadbeef"),
        ] {
            assert_eq!(error_signature(a), error_signature(b), "{a} / {b}");
        }
        assert_eq!(error_signature("container 3f2a9bc1d0e4 exited"), "container # exited");
        assert_eq!(error_signature("Dead beef, utf8 x86 ab12"), "dead beef, utf# x# #");
        assert_ne!(error_signature("disk full"), error_signature("disk dead"));
    }

    /// However long an error is (up to `MAX_ERROR_LEN`, any alphabet), its signature fits
    /// Postgres' index entries; two errors that differ only past the cut keep two signatures.
    #[test]
    fn a_long_error_has_a_signature_of_bounded_length_that_still_tells_errors_apart() {
        let letters: String = (0..MAX_ERROR_LEN).map(|i| (b'a' + ((i * 7919 + i / 26) % 26) as u8) as char).collect();
        let cyrillic = "ошибка соединения ".repeat(MAX_ERROR_LEN / "ошибка соединения ".len());
        for error in [letters.clone(), cyrillic, "İ".repeat(MAX_ERROR_LEN / 2)] {
            let mut incident = Incident::new("web", error.clone());
            incident.validate().unwrap();
            let sig = incident.signature();
            assert!(sig.len() <= MAX_SIGNATURE_LEN, "{} bytes", sig.len());
            assert_eq!(sig, error_signature(&error), "the same error, the same signature");
        }
        let mut other = letters.clone();
        other.replace_range(MAX_ERROR_LEN - 1.., "z");
        assert_ne!(error_signature(&letters), error_signature(&other));
        assert_eq!(error_signature(&letters[..MAX_SIGNATURE_LEN]), letters[..MAX_SIGNATURE_LEN], "short enough: kept");
    }

    /// A long error's fingerprint is the one builds before the signature's cap gave it
    /// (sha256 of service, host and the whole normalised error, computed apart): an incident
    /// joins the run opened for it before an upgrade, not a second one beside it.
    #[test]
    fn a_long_errors_fingerprint_did_not_change_with_the_signatures_cap() {
        let error = "connexion refusée par l'hôte ".repeat(60);
        let incident = Incident::new("web", error.trim());
        assert!(incident.signature().len() <= MAX_SIGNATURE_LEN);
        assert_eq!(incident.effective_fingerprint(), "f1e6bb2b8920852a10add6c47bf9a573");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<Incident>(r#"{"service":"a","error":"b","sevrity":"x"}"#).unwrap_err();
        assert!(e.to_string().contains("sevrity"), "{e}");
    }
}
