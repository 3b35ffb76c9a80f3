//! No tuning knob as a `pub` field of the facade's options structs: what a caller sets in a
//! `pub struct …Options` of `crates/poolipc` says what they want (a device, a limit, a
//! deadline); how the library gets there (spinning, polling, batch sizes, threads, backoff) is
//! in `Tuning` (`crates/poolipc/src/settings.rs`), one field of the options, so that the
//! knobs are found in one place and can change without touching the options.
//!
//! A field is a knob when one of the words of its name (split at `_`) starts with one of
//! [`KNOB_STEMS`] or is one of [`KNOB_UNITS`]: `spin_us`, `poll_interval`, `warmup`,
//! `set_aside`, `io_threads`, `max_retries` are; `handoff_timeout`, `device`, `max_users` are
//! not. Only `pub` structs whose name ends in `Options` and their `pub` named fields count.

use crate::rust_rules::code_only;

/// Where the facade's sources are.
pub(crate) const FACADE_SRC: &str = "crates/poolipc/src/";

/// A word of a field's name that starts with one of these makes it a knob.
pub(crate) const KNOB_STEMS: &[&str] = &[
    "spin", "yield", "poll", "warm", "aside", "micros", "nanos", "batch", "thread", "backoff",
    "retries", "retry", "interval",
];

/// A word of a field's name that is one of these (a unit finer than a caller thinks in) makes
/// it a knob.
pub(crate) const KNOB_UNITS: &[&str] = &["us", "ns"];

/// Whether a field of this name is a tuning knob.
pub(crate) fn is_knob(field: &str) -> bool {
    field
        .split('_')
        .any(|w| KNOB_UNITS.contains(&w) || KNOB_STEMS.iter().any(|s| w.starts_with(s)))
}

/// The offences of one Rust file of the facade at `path`.
pub(crate) fn offences_in(path: &str, text: &str) -> Vec<String> {
    let Ok(file) = syn::parse_file(text) else {
        // Not parsing is the Rust rules' offence already.
        return Vec::new();
    };
    let mut found = Vec::new();
    let mut knobs = Vec::new();
    structs(&file.items, &mut knobs);
    if knobs.is_empty() {
        return found;
    }
    let code = code_only(text);
    for (ty, field) in knobs {
        let line = line_of(&code, &ty, &field).map_or(String::new(), |n| format!("{n}:"));
        found.push(format!(
            "{path}:{line} `{ty}::{field}` is a tuning knob as a `pub` field of an options struct: move it into `Tuning` (crates/poolipc/src/settings.rs)"
        ));
    }
    found
}

/// (struct, field) of every knob among the `pub` fields of `pub` `…Options` structs, also in
/// inline modules.
fn structs(items: &[syn::Item], out: &mut Vec<(String, String)>) {
    for item in items {
        match item {
            syn::Item::Struct(s)
                if matches!(s.vis, syn::Visibility::Public(_))
                    && s.ident.to_string().ends_with("Options") =>
            {
                for f in &s.fields {
                    let (Some(name), syn::Visibility::Public(_)) = (&f.ident, &f.vis) else {
                        continue;
                    };
                    let name = name.to_string();
                    if is_knob(&name) {
                        out.push((s.ident.to_string(), name));
                    }
                }
            }
            syn::Item::Mod(m) => {
                if let Some((_, inner)) = &m.content {
                    structs(inner, out);
                }
            }
            _ => {}
        }
    }
}

/// The line (1-based) of `pub field` after `struct ty` in `code`.
fn line_of(code: &str, ty: &str, field: &str) -> Option<usize> {
    let lines: Vec<&str> = code.lines().collect();
    let start = lines.iter().position(|l| {
        l.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .collect::<Vec<_>>()
            .windows(2)
            .any(|w| w == ["struct", ty])
    })?;
    lines[start..]
        .iter()
        .position(|l| {
            let t = l.trim_start();
            t.strip_prefix("pub ")
                .map(str::trim_start)
                .and_then(|r| r.strip_prefix(field))
                .is_some_and(|r| r.trim_start().starts_with(':'))
        })
        .map(|n| start + n + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knob_names_are_told_by_their_words() {
        for knob in [
            "spin",
            "spin_us",
            "poll_interval",
            "warmup",
            "set_aside",
            "io_threads",
            "max_retries",
            "yield_after",
            "batch_size",
            "backoff",
            "wait_ns",
        ] {
            assert!(is_knob(knob), "{knob}");
        }
        for plain in ["handoff_timeout", "device", "max_users", "status", "limit"] {
            assert!(!is_knob(plain), "{plain}");
        }
    }

    #[test]
    fn a_pub_knob_of_a_pub_options_struct_is_an_offence() {
        let text = "pub struct ParentOptions {\n    pub device: u32,\n    /// doc\n    pub spin_us: u64,\n    poll: u8,\n}\n\
                    pub struct Tuning { pub spin: u8 }\n\
                    struct HiddenOptions { pub spin: u8 }\n";
        let found = offences_in("crates/poolipc/src/a.rs", text);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("crates/poolipc/src/a.rs:4: `ParentOptions::spin_us`"),
            "{found:?}"
        );
    }
}
