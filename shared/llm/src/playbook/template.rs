//! Playbook templates: `{name}` is a variable, `{{` and `}}` are literal braces, and any other
//! brace (`awk '{print $1}'`) is kept as written.

/// Longest template (diagnosis or command) a playbook may hold.
pub(crate) const MAX_TEMPLATE_LEN: usize = 1024;
/// Longest variable name; longer brace contents are literal text.
const MAX_NAME_LEN: usize = 64;

/// The template names a variable the service does not have: the alternative is unusable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Missing(pub String);

/// One piece of a template.
enum Piece<'a> {
    Text(&'a str),
    Var(&'a str),
}

/// Split `template` into text and variables, in order.
fn pieces(template: &str) -> Vec<Piece<'_>> {
    let bytes = template.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut text_start) = (0, 0);
    while i < bytes.len() {
        let escaped = matches!(bytes[i], b'{' | b'}') && bytes.get(i + 1) == Some(&bytes[i]);
        if escaped {
            // Emit the text so far plus one brace, drop the second.
            out.push(Piece::Text(&template[text_start..=i]));
            i += 2;
            text_start = i;
            continue;
        }
        if bytes[i] == b'{' {
            if let Some(len) = var_len(&bytes[i + 1..]) {
                out.push(Piece::Text(&template[text_start..i]));
                out.push(Piece::Var(&template[i + 1..i + 1 + len]));
                i += len + 2;
                text_start = i;
                continue;
            }
        }
        i += 1;
    }
    out.push(Piece::Text(&template[text_start..]));
    out
}

/// Length of a variable name starting at `rest` when it is closed by `}`.
fn var_len(rest: &[u8]) -> Option<usize> {
    let len = rest.iter().take_while(|b| b.is_ascii_alphanumeric() || **b == b'_').count();
    (len > 0 && len <= MAX_NAME_LEN && rest.get(len) == Some(&b'}')).then_some(len)
}

/// Render `template`, taking each variable's value from `lookup` verbatim.
pub(crate) fn render(template: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, Missing> {
    let mut out = String::with_capacity(template.len());
    for piece in pieces(template) {
        match piece {
            Piece::Text(t) => out.push_str(t),
            Piece::Var(v) => out.push_str(&lookup(v).ok_or_else(|| Missing(v.to_string()))?),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(name: &str) -> Option<String> {
        match name {
            "start" => Some("/usr/bin/toy start --port 1".into()),
            "pid" => Some("42".into()),
            _ => None,
        }
    }

    #[test]
    fn variables_are_replaced_verbatim() {
        assert_eq!(render("{start}", vars).unwrap(), "/usr/bin/toy start --port 1");
        assert_eq!(render("kill -9 {pid} now", vars).unwrap(), "kill -9 42 now");
    }

    #[test]
    fn missing_variable_is_named() {
        assert_eq!(render("kill {nope}", vars), Err(Missing("nope".into())));
    }

    #[test]
    fn other_braces_are_literal() {
        assert_eq!(render("awk '{print $1}' {pid}", vars).unwrap(), "awk '{print $1}' 42");
        assert_eq!(render("{{pid}} {", vars).unwrap(), "{pid} {");
        assert_eq!(render("}} } {}", vars).unwrap(), "} } {}");
        assert_eq!(render("é{pid}é", vars).unwrap(), "é42é");
    }
}
