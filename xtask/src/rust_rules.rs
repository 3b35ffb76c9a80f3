//! Tidy rules over the Rust sources. Code is told from comments and strings by a small lexer
//! ([`code_only`]) and, for matches, by `syn`, so that a comment or a string never passes for
//! code:
//!
//! - `unsafe` (a block, an `unsafe fn`, an `unsafe impl` or trait) only in the driver crate, the
//!   transport crate and the Python binding's DLPack module ([`UNSAFE_ALLOWED`]), and in tests
//!   (a fork, a counting allocator);
//! - every `unsafe` block and `unsafe impl` has a `// SAFETY:` comment on its line or in the
//!   comment just above it (clippy's `undocumented_unsafe_blocks` says the same for blocks);
//! - no wildcard arm (`_ =>`) in a `match` on the contract's actions or on a `Rung` outside the
//!   tests: a new action or rung must be a compile error at every match, not a silent default
//!   (a test picking one kind of action out of a list is not a default);
//! - no file over [`MAX_LINES`] lines outside the tests without the reason written at its top
//!   (a `//!` line starting `Why this file is long:`).

use syn::visit_mut::VisitMut;

/// Where `unsafe` may appear: paths starting with these.
pub(crate) const UNSAFE_ALLOWED: &[&str] = &[
    "crates/poolipc-driver/",
    "crates/poolipc-transport/",
    "crates/poolipc-python/src/dlpack.rs",
];

/// The longest a non-test source file may be without a reason at its top.
pub(crate) const MAX_LINES: usize = 800;

/// The marker of a long file's reason, in one of its first `//!` lines.
pub(crate) const LONG_REASON: &str = "//! Why this file is long:";

/// The enums a `match` must name every variant of: the contract's actions and the rungs.
const EXHAUSTIVE: &[&str] = &["ParentAction", "WorkerAction", "Rung"];

/// Whether `path` is test code: a `tests/` folder, a `tests.rs` or `*_tests.rs`, the tests
/// crate, the fuzz targets and the benches.
pub(crate) fn is_test_path(path: &str) -> bool {
    path.starts_with("tests/")
        || path.starts_with("fuzz/")
        || path.contains("/tests/")
        || path.contains("/benches/")
        || path.ends_with("/tests.rs")
        || path.ends_with("_tests.rs")
}

/// The offences of one Rust file.
pub(crate) fn offences_in(path: &str, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() > MAX_LINES
        && !is_test_path(path)
        && !lines
            .iter()
            .take(40)
            .any(|l| l.trim_start().starts_with(LONG_REASON))
    {
        found.push(format!(
            "{path}: {} lines, over {MAX_LINES} without `{LONG_REASON} ...` at its top: split it by job, or say why not",
            lines.len()
        ));
    }
    unsafe_offences(path, text, &lines, &mut found);
    match syn::parse_file(text) {
        Ok(_) if is_test_path(path) => {}
        Ok(mut file) => {
            let mut v = Matches {
                path,
                within: Vec::new(),
                found: &mut found,
            };
            v.visit_file_mut(&mut file);
        }
        Err(e) => found.push(format!("{path}: does not parse: {e}")),
    }
    found
}

/// `text` with every comment, string and character literal blanked to spaces (line breaks
/// kept), so that a search of the rest finds only code.
pub(crate) fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == b'/' && next == Some(b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && next == Some(b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if c == b'r' && matches!(next, Some(b'#' | b'"')) && !ident_before(b, i) {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            out.extend(std::iter::repeat_n(b' ', j + 1 - i));
            i = j + 1;
            while i < b.len() && !b[i..].starts_with(&close) {
                blank(&mut out, b[i]);
                i += 1;
            }
            let end = (i + close.len()).min(b.len());
            out.extend(std::iter::repeat_n(b' ', end - i));
            i = end;
        } else if c == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                blank(&mut out, b[i]);
                i += 1;
            }
            if i < b.len() {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}'), or a lifetime ('a): only the former blanked.
            let lit_end = if next == Some(b'\\') {
                b[i + 2..]
                    .iter()
                    .position(|&x| x == b'\'')
                    .map(|p| i + 2 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                None
            };
            match lit_end {
                Some(end) => {
                    out.extend(std::iter::repeat_n(b' ', end + 1 - i));
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// The `unsafe` offences: where it may not be, and blocks and impls without their SAFETY.
fn unsafe_offences(path: &str, text: &str, lines: &[&str], found: &mut Vec<String>) {
    let allowed = is_test_path(path) || UNSAFE_ALLOWED.iter().any(|p| path.starts_with(p));
    let code = code_only(text);
    for (n, line) in code.lines().enumerate() {
        let mut from = 0;
        while let Some(at) = line[from..].find("unsafe") {
            let start = from + at;
            let end = start + "unsafe".len();
            from = end;
            let b = line.as_bytes();
            let word_before =
                start > 0 && (b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
            let word_after = b
                .get(end)
                .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_');
            if word_before || word_after {
                continue;
            }
            // What follows `unsafe` on its line, or on the next code line.
            let after = line[end..].trim_start();
            let after = if after.is_empty() {
                code.lines()
                    .skip(n + 1)
                    .flat_map(str::split_whitespace)
                    .next()
                    .unwrap_or("")
            } else {
                after
            };
            let what = if after.starts_with('{') {
                "an `unsafe` block"
            } else if after.starts_with("impl") {
                "an `unsafe impl`"
            } else if after.starts_with("trait") {
                "an `unsafe trait`"
            } else if after.starts_with("extern") {
                "an `unsafe extern`"
            } else {
                "an `unsafe fn`"
            };
            if !allowed {
                found.push(format!(
                    "{path}:{}: {what} outside the driver, the transport and the DLPack module",
                    n + 1
                ));
            } else if matches!(what, "an `unsafe` block" | "an `unsafe impl`")
                && !safety_said(lines, n)
            {
                found.push(format!(
                    "{path}:{}: {what} without a `// SAFETY:` comment on its line or just above it",
                    n + 1
                ));
            }
        }
    }
}

/// Whether line `n` (0-based) carries a `SAFETY:` comment, or the comment lines above it do
/// (through attributes and up to three lines of the statement the block is part of).
fn safety_said(lines: &[&str], n: usize) -> bool {
    if lines.get(n).is_some_and(|l| l.contains("SAFETY:")) {
        return true;
    }
    let mut i = n;
    let mut code_lines = 0;
    while i > 0 {
        i -= 1;
        let l = lines[i].trim_start();
        if l.starts_with("//") {
            if l.contains("SAFETY:") {
                return true;
            }
            continue;
        }
        if l.starts_with("#[") {
            continue;
        }
        if l.contains("SAFETY:") {
            return true;
        }
        code_lines += 1;
        if code_lines > 3 || l.ends_with(';') || l.ends_with('}') {
            return false;
        }
    }
    false
}

/// Finds wildcard arms in matches on [`EXHAUSTIVE`] enums; names the function they are in
/// (the spans carry no lines without proc-macro2's `span-locations`, which xtask does without).
struct Matches<'a> {
    path: &'a str,
    within: Vec<String>,
    found: &'a mut Vec<String>,
}

impl VisitMut for Matches<'_> {
    fn visit_item_fn_mut(&mut self, f: &mut syn::ItemFn) {
        self.within.push(f.sig.ident.to_string());
        syn::visit_mut::visit_item_fn_mut(self, f);
        self.within.pop();
    }

    fn visit_impl_item_fn_mut(&mut self, f: &mut syn::ImplItemFn) {
        self.within.push(f.sig.ident.to_string());
        syn::visit_mut::visit_impl_item_fn_mut(self, f);
        self.within.pop();
    }

    fn visit_trait_item_fn_mut(&mut self, f: &mut syn::TraitItemFn) {
        self.within.push(f.sig.ident.to_string());
        syn::visit_mut::visit_trait_item_fn_mut(self, f);
        self.within.pop();
    }

    fn visit_expr_match_mut(&mut self, m: &mut syn::ExprMatch) {
        if let Some(name) = m.arms.iter().find_map(|a| exhaustive_enum(&a.pat)) {
            let wild = m
                .arms
                .iter()
                .filter(|a| matches!(a.pat, syn::Pat::Wild(_)) && a.guard.is_none())
                .count();
            if wild > 0 {
                let within = self
                    .within
                    .last()
                    .map_or("the file's items", String::as_str);
                self.found.push(format!(
                    "{}: in `{within}`: a `_ =>` arm in a match on `{name}`: name every variant, so that a new one is a compile error there",
                    self.path
                ));
            }
        }
        syn::visit_mut::visit_expr_match_mut(self, m);
    }
}

/// The exhaustive enum an arm's pattern names (`ParentAction::Send { .. }`, `Rung::Arena`,
/// also inside `|`, references, parentheses and bindings).
fn exhaustive_enum(p: &syn::Pat) -> Option<&'static str> {
    let path = match p {
        syn::Pat::Path(p) => &p.path,
        syn::Pat::Struct(p) => &p.path,
        syn::Pat::TupleStruct(p) => &p.path,
        syn::Pat::Or(o) => return o.cases.iter().find_map(exhaustive_enum),
        syn::Pat::Reference(r) => return exhaustive_enum(&r.pat),
        syn::Pat::Ident(i) => return i.subpat.as_ref().and_then(|(_, p)| exhaustive_enum(p)),
        syn::Pat::Paren(p) => return exhaustive_enum(&p.pat),
        _ => return None,
    };
    let n = path.segments.len();
    if n < 2 {
        return None;
    }
    let owner = path.segments[n - 2].ident.to_string();
    EXHAUSTIVE.iter().copied().find(|e| owner == *e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_strings_are_not_code() {
        let text = "let a = \"unsafe { x }\"; // unsafe\n/* unsafe /* nested */ unsafe */ let c = '\"'; let r = r#\"unsafe \"# ; fn f<'a>(x: &'a u8) {}\n";
        let code = code_only(text);
        assert!(!code.contains("unsafe"), "{code}");
        assert!(code.contains("fn f<'a>(x: &'a u8)"), "{code}");
        assert_eq!(code.lines().count(), text.lines().count());
    }

    #[test]
    fn unsafe_outside_the_allowed_crates_is_an_offence() {
        let text = "fn f() {\n    // SAFETY: fine\n    unsafe { g() }\n}\n";
        let found = offences_in("crates/poolipc/src/a.rs", text);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains(":3: an `unsafe` block outside"),
            "{found:?}"
        );
        // A comment, a string or a lint naming it is not code.
        let text = "#![forbid(unsafe_code)]\n// unsafe { }\nconst S: &str = \"unsafe { x }\";\n";
        assert!(offences_in("crates/poolipc/src/a.rs", text).is_empty());
        assert!(
            offences_in("crates/poolipc-python/src/dlpack.rs", "unsafe fn f() {}\n").is_empty()
        );
        // Tests may, with their SAFETY.
        let said = "fn f() {\n    // SAFETY: fine\n    unsafe { g() }\n}\n";
        assert!(offences_in("tests/tests/a.rs", said).is_empty());
        assert_eq!(
            offences_in("tests/tests/a.rs", "fn f() { unsafe { g() } }\n").len(),
            1
        );
    }

    #[test]
    fn an_unsafe_block_needs_its_safety_comment() {
        let bare = "fn f() {\n    let a = 1;\n    unsafe { g(a) }\n}\n";
        let found = offences_in("crates/poolipc-driver/src/a.rs", bare);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains(":3:") && found[0].contains("SAFETY"),
            "{found:?}"
        );
        let said = "fn f() {\n    // SAFETY: g takes any value.\n    // (a second line)\n    unsafe { g(1) }\n}\n";
        assert!(offences_in("crates/poolipc-driver/src/a.rs", said).is_empty());
        let stmt = "fn f() {\n    // SAFETY: g takes any value.\n    let r =\n        unsafe { g(1) };\n}\n";
        assert!(offences_in("crates/poolipc-driver/src/a.rs", stmt).is_empty());
        let inline = "fn f() {\n    let r = unsafe { g(1) }; // SAFETY: g takes any value.\n}\n";
        assert!(offences_in("crates/poolipc-driver/src/a.rs", inline).is_empty());
        let impl_bare = "struct S;\nunsafe impl Send for S {}\n";
        assert_eq!(
            offences_in("crates/poolipc-transport/src/a.rs", impl_bare).len(),
            1
        );
        // An `unsafe fn` says its contract in `# Safety`, not here.
        assert!(offences_in("crates/poolipc-driver/src/a.rs", "unsafe fn f() {}\n").is_empty());
    }

    #[test]
    fn a_wildcard_on_actions_or_rungs_is_an_offence() {
        let text = "fn f(a: ParentAction, r: Rung) {\n match a { ParentAction::Send { .. } => {}\n _ => {} }\n match r { Rung::PoolPointer | Rung::Arena => {}, _ => {} }\n match r { Rung::Arena => {}, _ if cold() => {}, Rung::PoolPointer => {} }\n match 3 { 1 => {}, _ => {} }\n}\n";
        let found = offences_in("crates/poolipc/src/a.rs", text);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0].contains("`f`") && found[0].contains("ParentAction"),
            "{found:?}"
        );
        assert!(found[1].contains("`Rung`"), "{found:?}");
        assert!(offences_in("crates/poolipc/src/tests/a.rs", text).is_empty());
    }

    #[test]
    fn a_long_file_needs_its_reason() {
        let long = "fn f() {}\n".repeat(MAX_LINES + 1);
        assert_eq!(offences_in("crates/poolipc/src/a.rs", &long).len(), 1);
        assert!(offences_in("crates/poolipc/src/tests/a.rs", &long).is_empty());
        assert!(offences_in("crates/poolipc/src/a_tests.rs", &long).is_empty());
        let reasoned = format!("{LONG_REASON} one state machine.\n{long}");
        assert!(offences_in("crates/poolipc/src/a.rs", &reasoned).is_empty());
    }
}
