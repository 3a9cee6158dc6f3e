//! JSON Schemas of the public message types, generated from the Rust types.
//!
//! The checked-in copies live in `schemas/` at the repository root; the `schemas`
//! integration test fails when they drift from the types (regenerate with
//! `PITCREW_BLESS=1 cargo test -p pitcrew-model --test schemas`).

use crate::{ApprovalDecision, ApprovalRequest, Incident, RunEvent, RunState};
use schemars::{schema_for, Schema};
use serde_json::Value;

/// Base of every schema's `$id`.
pub const SCHEMA_ID_BASE: &str = "https://pitcrew.dev/schemas/";

fn finish(file: &'static str, mut schema: Schema) -> (&'static str, Value) {
    let id = format!("{SCHEMA_ID_BASE}{file}");
    schema.insert("$id".to_string(), Value::String(id));
    let mut value = schema.to_value();
    drop_clock_defaults(&mut value);
    (file, value)
}

/// Remove `default` from date-time schemas. A timestamp's default comes from the clock
/// (`#[serde(default = "Utc::now")]`), so schemars would bake in the moment the schema
/// was generated: meaningless to readers and different on every run.
fn drop_clock_defaults(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if map.get("format").and_then(Value::as_str) == Some("date-time") {
                map.remove("default");
            }
            map.values_mut().for_each(drop_clock_defaults);
        }
        Value::Array(items) => items.iter_mut().for_each(drop_clock_defaults),
        _ => {}
    }
}

/// Every public schema as (file name under `schemas/`, schema).
pub fn public_schemas() -> Vec<(&'static str, Value)> {
    vec![
        finish("incident.schema.json", schema_for!(Incident)),
        finish("run-state.schema.json", schema_for!(RunState)),
        finish("approval-request.schema.json", schema_for!(ApprovalRequest)),
        finish("approval-decision.schema.json", schema_for!(ApprovalDecision)),
        finish("event.schema.json", schema_for!(RunEvent)),
    ]
}

/// A schema rendered as it is stored: pretty JSON with a trailing newline.
pub fn render(schema: &Value) -> String {
    let mut s = serde_json::to_string_pretty(schema).expect("a JSON value always serialises");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schema_has_an_id_and_a_unique_file() {
        let all = public_schemas();
        let mut names: Vec<_> = all.iter().map(|(f, _)| *f).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
        for (file, schema) in &all {
            assert_eq!(schema["$id"], format!("{SCHEMA_ID_BASE}{file}"));
        }
    }

    #[test]
    fn generation_is_deterministic() {
        // ApprovalDecision.decided_at defaults to Utc::now(): that must not leak in.
        let first = public_schemas();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(first, public_schemas());
        let (_, decision) = &first[3];
        assert_eq!(decision["properties"]["decided_at"].get("default"), None);
    }
}
