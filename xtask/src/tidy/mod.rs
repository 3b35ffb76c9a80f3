//! Tidy rules over the tracked files (the model: rust-analyzer's `xtask/src/tidy.rs`), run by
//! `cargo xtask ci` and as this crate's test.
//!
//! - Nothing links outside the repository: no `../shared` or `/work/shared` path, and no
//!   mention of the design notes that lived there (`DESIGN.md`, `FACTS.md`, `GPU.md`); the
//!   project's own words are in `docs/`.
//! - Every relative link of a Markdown file names a file or folder that exists.
//! - No work-log words: the repository speaks to its users, who never saw the work's steps,
//!   tickets or numbered runs ("stop 12", "issue 3", "call 2", [`WORK_LOG`]). A figure gives
//!   its date and hardware instead. The CHANGELOG is held to it too: it says what changed for
//!   users, in their words.
//! - The Rust rules of [`crate::rust_rules`]: where `unsafe` may be and what it must say, no
//!   wildcard arm on the contract's actions or the rungs, no long file without its reason.
//! - No import cycle between the modules of a crate ([`cycles`]).
//! - No tuning knob as a `pub` field of the facade's options structs ([`knobs`]).
//! - The facade's public items within their ceiling ([`facade_size`]).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

mod cycles;
mod facade_size;
mod knobs;

/// What no tracked file may contain.
const OUTSIDE: &[&str] = &[
    "../shared",
    "/work/shared",
    "DESIGN.md",
    "FACTS.md",
    "GPU.md",
];

/// Tracked paths the rules leave alone: this file (which names what it forbids).
const EXEMPT: &[&str] = &["xtask/src/tidy/mod.rs"];

/// Work-log words followed by a number (" 12"): a step, a ticket, a numbered run.
const NUMBERED: &[&str] = &["stop", "stops", "issue", "issues", "call", "calls"];

/// Work-log phrases, matched without regard to case.
const WORK_LOG: &[&str] = &["device budget", "the seed's way", "seed's temper"];

/// The work-log words of one line, as the offence's text: `stop 12`, `device budget`.
fn work_log_words(line: &str) -> Vec<String> {
    let lower = line.to_ascii_lowercase();
    let mut found: Vec<String> = WORK_LOG
        .iter()
        .filter(|p| lower.contains(*p))
        .map(|p| (*p).to_string())
        .collect();
    let bytes = lower.as_bytes();
    for word in NUMBERED {
        let mut from = 0;
        while let Some(at) = lower[from..].find(word) {
            let start = from + at;
            let end = start + word.len();
            from = end;
            let starts_word = start == 0 || !bytes[start - 1].is_ascii_alphanumeric();
            let then_number =
                bytes.get(end) == Some(&b' ') && bytes.get(end + 1).is_some_and(u8::is_ascii_digit);
            // "stops" is found both as itself and as "stop" + "s": only the whole word counts.
            if starts_word && then_number {
                let digits = lower[end + 1..]
                    .bytes()
                    .take_while(u8::is_ascii_digit)
                    .count();
                found.push(lower[start..end + 1 + digits].to_string());
            }
        }
    }
    found
}

/// Checks the tracked files under `root`; the error lists every offence.
pub(crate) fn check(root: &Path) -> Result<()> {
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
        .context("git ls-files")?;
    if !out.status.success() {
        bail!(
            "git ls-files failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut offences = Vec::new();
    let mut rust = Vec::new();
    for path in String::from_utf8_lossy(&out.stdout).split('\0') {
        if path.is_empty() || EXEMPT.iter().any(|e| path.starts_with(e)) {
            continue;
        }
        let full = root.join(path);
        // Binary files, symlinks to folders and files deleted but not yet staged: skipped.
        let Ok(text) = std::fs::read_to_string(&full) else {
            continue;
        };
        offences.extend(offences_in(path, &text, |target| {
            full_exists(root, path, target)
        }));
        if path.ends_with(".rs") {
            offences.extend(crate::rust_rules::offences_in(path, &text));
            if path.starts_with(knobs::FACADE_SRC) {
                offences.extend(knobs::offences_in(path, &text));
            }
            rust.push((path.to_string(), text));
        }
    }
    offences.extend(cycles::offences(&rust, cycles::CYCLES_ALLOWED));
    let (over, facade_items) = facade_size::offences(root, facade_size::FACADE_MAX_ITEMS)?;
    offences.extend(over);
    if !offences.is_empty() {
        bail!(
            "tidy: {} offence(s):\n{}",
            offences.len(),
            offences.join("\n")
        );
    }
    eprintln!(
        "tidy: no link leaves the repository; every Markdown link resolves; no work-log words; unsafe only where allowed and each block said safe; no wildcard on actions or rungs; no long file without its reason; no import cycle between modules ({} allowed for now); no tuning knob in an options struct; the facade's {facade_items} public items within its ceiling of {}",
        cycles::CYCLES_ALLOWED.len(),
        facade_size::FACADE_MAX_ITEMS
    );
    Ok(())
}

fn full_exists(root: &Path, from: &str, target: &str) -> bool {
    let dir = Path::new(from).parent().unwrap_or(Path::new(""));
    root.join(dir).join(target).exists()
}

/// The offences in one file's text; `exists` says whether a relative link target exists.
fn offences_in(path: &str, text: &str, exists: impl Fn(&str) -> bool) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for bad in OUTSIDE {
            if line.contains(bad) {
                found.push(format!(
                    "{path}:{}: `{bad}` is outside the repository (see docs/)",
                    n + 1
                ));
            }
        }
        for words in work_log_words(line) {
            found.push(format!(
                "{path}:{}: `{words}` is a work-log word: say what it means to a user (a date and hardware for a figure)",
                n + 1
            ));
        }
        if !path.ends_with(".md") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split('#').next().unwrap_or("");
            rest = &rest[end..];
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            if !exists(target) {
                found.push(format!(
                    "{path}:{}: the link `{target}` names nothing in the repository",
                    n + 1
                ));
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repository_is_tidy() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root");
        check(root).expect("tidy");
    }

    #[test]
    fn links_outside_and_dangling_links_are_offences() {
        let text = "see ../shared/DESIGN.md\n[ok](docs/design.md) [gone](docs/nothing.md#x) [web](https://x.org/a)\n";
        let found = offences_in("README.md", text, |t| t == "docs/design.md");
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found[0].starts_with("README.md:1: `../shared`"));
        assert!(found[1].starts_with("README.md:1: `DESIGN.md`"));
        assert!(found[2].contains("`docs/nothing.md`"));
        // Outside Markdown only the paths count.
        assert!(offences_in("src/lib.rs", "// [gone](nothing.md)\n", |_| false).is_empty());
    }

    #[test]
    fn work_log_words_are_offences_wherever_they_are() {
        let text = "//! The arena (issue 22, item 3), since Stop 36; calls 4 and call 12.\n\
                    the device budget ran out, the seed's way\n\
                    the workers stop at 7200 jobs/s; nonstop 3; stop_timeout 5\n";
        let found = offences_in("tests/tests/x.rs", text, |_| true);
        let words: Vec<&str> = found
            .iter()
            .map(|f| f.split('`').nth(1).expect("quoted"))
            .collect();
        assert_eq!(
            words,
            [
                "stop 36",
                "issue 22",
                "call 12",
                "calls 4",
                "device budget",
                "the seed's way"
            ],
            "{found:?}"
        );
        assert!(found[0].starts_with("tests/tests/x.rs:1:"), "{found:?}");
        assert!(found[4].starts_with("tests/tests/x.rs:2:"), "{found:?}");
    }
}
