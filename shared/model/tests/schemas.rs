//! The checked-in JSON Schemas in `schemas/` must match the Rust types.
//!
//! Regenerate after changing a public type:
//! `PITCREW_BLESS=1 cargo test -p pitcrew-model --test schemas`

use pitcrew_model::schema::{public_schemas, render};
use pitcrew_model::{Incident, Severity};
use std::path::PathBuf;

const BLESS: &str = "PITCREW_BLESS=1 cargo test -p pitcrew-model --test schemas";

fn schema_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../schemas")
}

fn blessing() -> bool {
    std::env::var("PITCREW_BLESS").is_ok_and(|v| v == "1")
}

#[test]
fn checked_in_schemas_match_the_types() {
    let dir = schema_dir();
    let mut drifted = Vec::new();
    for (file, schema) in public_schemas() {
        let path = dir.join(file);
        let want = render(&schema);
        if blessing() {
            std::fs::create_dir_all(&dir).expect("create schemas/");
            std::fs::write(&path, &want).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(have) if have == want => {}
            Ok(_) => drifted.push(format!("{file} drifted from the Rust types")),
            Err(e) => drifted.push(format!("{file} could not be read ({e})")),
        }
    }
    assert!(
        drifted.is_empty(),
        "schemas in {} are out of date:\n  {}\nregenerate with: {BLESS}",
        dir.display(),
        drifted.join("\n  ")
    );
}

#[test]
fn example_incident_parses_and_schema_requires_service_and_error() {
    let example =
        r#"{"service":"web","error":"connection refused","severity":"critical","labels":{"team":"payments"}}"#;
    let incident: Incident = serde_json::from_str(example).expect("example incident deserialises");
    assert_eq!(incident.service, "web");
    assert_eq!(incident.error, "connection refused");
    assert_eq!(incident.severity, Severity::Critical);
    assert_eq!(incident.labels.get("team").map(String::as_str), Some("payments"));

    let (_, schema) =
        public_schemas().into_iter().find(|(f, _)| *f == "incident.schema.json").expect("incident schema is public");
    let required: Vec<&str> = schema["required"]
        .as_array()
        .expect("incident schema has a required list")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    for field in ["service", "error"] {
        assert!(required.contains(&field), "incident schema must require '{field}', has {required:?}");
    }
}
