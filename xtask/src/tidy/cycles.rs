//! No import cycles between the modules of a crate: what two modules both need lives in a
//! module below both, so that no module imports the module that imports it.
//!
//! The rule, precisely:
//!
//! - A module is a file of a crate's `src/`: `lib.rs` or `main.rs` is the root, `foo.rs` or
//!   `foo/mod.rs` is `foo`, `foo/bar.rs` is `foo::bar`. An inline `mod x { .. }` belongs to its
//!   file's module (it only changes what `super::` and `self::` mean inside it).
//! - A file names a module when a path in its code starts with `crate::`, `super::` or
//!   `self::` (in a `use` tree, braces and all, or anywhere in the code) and, resolved, lies
//!   under that module: the named module is the longest prefix of the resolved path that is a
//!   module. Paths are taken as written: a re-export is not followed to where its item is
//!   defined. A path not starting with those words names an external crate or a child of the
//!   module it is in, never a cycle.
//! - An edge: file A names module B, where B is neither A itself nor an ancestor of A (a child
//!   naming its parent's items, through `super::` or `crate::`, is nesting) nor a descendant
//!   of A (a parent naming its children's items is nesting too). The edge is lifted to the
//!   two children of their lowest common ancestor that contain A and B:
//!   `crate::sim::driver::alloc` naming `crate::api::X` is the edge `sim` → `api` among the
//!   root's children. So siblings are compared, at the top level and inside every directory.
//! - Every strongly connected component of more than one sibling is an offence, listed with
//!   each member's file and, for every edge inside it, the first `file:line` that makes it.
//! - Test code is left out: files that [`is_test_path`] says are tests, files of modules
//!   declared `#[cfg(test)] mod x;`, and items under `#[cfg(test)]`. A test sees the whole crate
//!   to build its fixtures; the rule is about the library's layers.

use std::collections::{BTreeMap, BTreeSet};

use crate::rust_rules::{code_only, is_test_path};

/// Cycles let stand for now: (crate, the modules of the cycle, as `a::b` paths). Empty: no
/// crate has one. An entry is for a cycle that cannot be cut in the change that finds it; an
/// entry whose cycle no longer exists is itself an offence, so the list can only shrink. An
/// entry matches a cycle of exactly its modules: a cycle that gains a member is an offence,
/// and so is the entry.
pub(crate) const CYCLES_ALLOWED: &[(&str, &[&str])] = &[];

/// A module's path below its crate's root (empty for the root).
type Module = Vec<String>;

/// Where a file names a module.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Site {
    file: String,
    line: usize,
    /// The path as written, `crate::a::B`.
    path: String,
}

/// A cycle: the crate, its members (siblings, sorted), each member's file, and one site for
/// every edge among them.
#[derive(Debug)]
struct Cycle {
    krate: String,
    members: Vec<Module>,
    files: Vec<String>,
    edges: Vec<(Module, Module, Site)>,
}

fn show(m: &[String]) -> String {
    if m.is_empty() {
        "crate".to_string()
    } else {
        m.join("::")
    }
}

/// The offences of the tracked Rust files (repository path, text): each crate's cycles not in
/// `allowed`, and each entry of `allowed` that matches no cycle.
pub(crate) fn offences(files: &[(String, String)], allowed: &[(&str, &[&str])]) -> Vec<String> {
    let mut crates: BTreeMap<&str, Vec<(&str, &str)>> = BTreeMap::new();
    for (path, text) in files {
        let Some(rest) = path.strip_prefix("crates/") else {
            continue;
        };
        let Some((krate, in_crate)) = rest.split_once('/') else {
            continue;
        };
        if in_crate.starts_with("src/") && path.ends_with(".rs") {
            crates.entry(krate).or_default().push((path, text));
        }
    }
    let mut found = Vec::new();
    let mut seen: BTreeSet<(String, Vec<String>)> = BTreeSet::new();
    for (krate, files) in &crates {
        for cycle in cycles(krate, &format!("crates/{krate}/src/"), files) {
            let names: Vec<String> = cycle.members.iter().map(|m| show(m)).collect();
            let key = (cycle.krate.clone(), names.clone());
            let listed = allowed.iter().any(|(k, ms)| {
                let mut ms: Vec<String> = ms.iter().map(|m| (*m).to_string()).collect();
                ms.sort();
                *k == cycle.krate && ms == names
            });
            seen.insert(key);
            if !listed {
                found.push(describe(&cycle));
            }
        }
    }
    for (k, ms) in allowed {
        let mut names: Vec<String> = ms.iter().map(|m| (*m).to_string()).collect();
        names.sort();
        if !seen.contains(&((*k).to_string(), names.clone())) {
            found.push(format!(
                "xtask/src/tidy/cycles.rs: CYCLES_ALLOWED lists the cycle {} in {k}, which no longer exists: remove the entry",
                names.join(" ⇄ ")
            ));
        }
    }
    found
}

fn describe(c: &Cycle) -> String {
    let mut s = format!(
        "crates/{}: an import cycle between {}: move what they share into a module below them",
        c.krate,
        c.members
            .iter()
            .zip(&c.files)
            .map(|(m, f)| format!("`{}` ({f})", show(m)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (a, b, site) in &c.edges {
        s.push_str(&format!(
            "\n    `{}` → `{}`: {}:{} names `{}`",
            show(a),
            show(b),
            site.file,
            site.line,
            site.path
        ));
    }
    s
}

/// The module of a file at `rel` (its path below `src/`).
fn module_of(rel: &str) -> Module {
    let stem = rel.strip_suffix(".rs").unwrap_or(rel);
    let mut parts: Vec<String> = stem.split('/').map(str::to_string).collect();
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        parts.clear();
    } else if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The cycles among the modules of one crate, from its files (repository path, text), all under
/// `src` (the crate's `src/` folder, with its slash).
fn cycles(krate: &str, src: &str, files: &[(&str, &str)]) -> Vec<Cycle> {
    let mut sorted: Vec<(&str, &str)> = files.to_vec();
    sorted.sort();
    let modules: BTreeMap<Module, &str> = sorted
        .iter()
        .filter_map(|(p, _)| p.strip_prefix(src).map(|rel| (module_of(rel), *p)))
        .collect();
    // parent → (from child, to child) → the first site.
    let mut edges: BTreeMap<Module, BTreeMap<(String, String), Site>> = BTreeMap::new();
    let mut scanned = Vec::new();
    // Modules declared `#[cfg(test)] mod x;`: their files are test code, whatever their names.
    let mut test_modules: Vec<Module> = Vec::new();
    for (path, text) in &sorted {
        let Some(rel) = path.strip_prefix(src) else {
            continue;
        };
        if is_test_path(path) {
            continue;
        }
        let from = module_of(rel);
        let (named, tests) = named_paths(&code_only(text));
        test_modules.extend(tests.into_iter().map(|t| [from.clone(), t].concat()));
        scanned.push((*path, from, named));
    }
    for (path, from, named) in scanned {
        if test_modules.iter().any(|t| from.starts_with(t)) {
            continue;
        }
        for named in named {
            let Some(target) = resolve(&from, &named.within, &named.segments) else {
                continue;
            };
            let Some(to) = (1..=target.len())
                .rev()
                .map(|n| &target[..n])
                .find(|m| modules.contains_key(*m))
            else {
                continue;
            };
            let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            // `to` an ancestor of (or the same as) `from`, or a descendant: nesting.
            if common == to.len() || common == from.len() {
                continue;
            }
            let site = Site {
                file: (*path).to_string(),
                line: named.line,
                path: named.segments.join("::"),
            };
            edges
                .entry(from[..common].to_vec())
                .or_default()
                .entry((from[common].clone(), to[common].clone()))
                .or_insert(site);
        }
    }
    let mut found = Vec::new();
    for (parent, among) in &edges {
        for component in components(among.keys()) {
            let member = |name: &String| {
                let mut m = parent.clone();
                m.push(name.clone());
                m
            };
            let members: Vec<Module> = component.iter().map(member).collect();
            let files = members
                .iter()
                .map(|m| {
                    modules
                        .get(m)
                        .map_or_else(|| format!("{src}{}/", m.join("/")), |f| (*f).to_string())
                })
                .collect();
            let edges = among
                .iter()
                .filter(|((a, b), _)| component.contains(a) && component.contains(b))
                .map(|((a, b), site)| (member(a), member(b), site.clone()))
                .collect();
            found.push(Cycle {
                krate: krate.to_string(),
                members,
                files,
                edges,
            });
        }
    }
    found
}

/// The strongly connected components of more than one node of the graph with these edges,
/// each sorted. The graphs are a directory's modules, a few dozen at most: reachability from
/// every node is plenty.
fn components<'a>(edges: impl Iterator<Item = &'a (String, String)>) -> Vec<BTreeSet<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges {
        next.entry(a).or_default().push(b);
        next.entry(b).or_default();
    }
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from];
        while let Some(n) = todo.pop() {
            for m in next.get(n).into_iter().flatten() {
                if seen.insert(*m) {
                    todo.push(m);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&str, BTreeSet<&str>> = next.keys().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<BTreeSet<String>> = Vec::new();
    for (n, r) in &reaches {
        let component: BTreeSet<String> = r
            .iter()
            .filter(|m| reaches[*m].contains(n))
            .map(|m| (*m).to_string())
            .collect();
        if component.len() > 1 && !out.contains(&component) {
            out.push(component);
        }
    }
    out
}

/// The module path a path names, from the file's module `from` and the inline modules it is
/// written in; `None` for a path that starts elsewhere (an external crate, a child).
fn resolve(from: &[String], within: &[String], segments: &[String]) -> Option<Vec<String>> {
    let mut at: Vec<String> = from.iter().chain(within).cloned().collect();
    let mut rest = segments;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            at.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {}
        _ => return None,
    }
    while rest.first().is_some_and(|s| s == "super") {
        at.pop()?;
        rest = &rest[1..];
    }
    at.extend(rest.iter().cloned());
    Some(at)
}

/// A path a file's code names: the inline modules it is written in, its segments, its line.
#[derive(Debug, PartialEq)]
struct Named {
    within: Vec<String>,
    segments: Vec<String>,
    line: usize,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Colons,
    Punct(char),
}

/// The tokens of code (comments and strings already blanked), each with its line (1-based).
fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80 {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] >= 0x80) {
                i += 1;
            }
            out.push((Tok::Ident(code[start..i].to_string()), line));
        } else if c == b':' && b.get(i + 1) == Some(&b':') {
            out.push((Tok::Colons, line));
            i += 2;
        } else {
            out.push((Tok::Punct(c as char), line));
            i += 1;
        }
    }
    out
}

fn ident(t: Option<&(Tok, usize)>) -> Option<&str> {
    match t {
        Some((Tok::Ident(s), _)) => Some(s),
        _ => None,
    }
}

fn is(t: Option<&(Tok, usize)>, want: &Tok) -> bool {
    t.is_some_and(|(x, _)| x == want)
}

/// The paths starting `crate::`, `super::` or `self::` in `code` (comments and strings blanked),
/// outside test code: every leaf of a `use` tree, and every other such path in full; and the
/// modules declared `#[cfg(test)] mod x;` (as paths below the file's module: `x`, or
/// `inner::x` inside an inline `mod inner`).
fn named_paths(code: &str) -> (Vec<Named>, Vec<Vec<String>>) {
    let toks = tokens(code);
    let mut out = Vec::new();
    let mut test_mods = Vec::new();
    // One frame per open brace: the inline module it opens, if any, and whether it is test code.
    let mut frames: Vec<(Option<String>, bool)> = Vec::new();
    let mut pending_mod: Option<String> = None;
    let mut pending_test = false;
    let mut i = 0;
    while i < toks.len() {
        let in_test = pending_test || frames.iter().any(|(_, t)| *t);
        let within = || frames.iter().filter_map(|(m, _)| m.clone()).collect();
        match &toks[i].0 {
            Tok::Punct('#') => {
                // `#[cfg(test)]` (or `#![cfg(test)]`, the whole file).
                let mut j = i + 1;
                let inner = is(toks.get(j), &Tok::Punct('!'));
                if inner {
                    j += 1;
                }
                let cfg_test = [
                    Tok::Punct('['),
                    Tok::Ident("cfg".into()),
                    Tok::Punct('('),
                    Tok::Ident("test".into()),
                    Tok::Punct(')'),
                    Tok::Punct(']'),
                ];
                if cfg_test
                    .iter()
                    .enumerate()
                    .all(|(k, t)| is(toks.get(j + k), t))
                {
                    if inner {
                        return (Vec::new(), Vec::new());
                    }
                    pending_test = true;
                    i = j + cfg_test.len();
                    continue;
                }
                i += 1;
            }
            Tok::Ident(w) if w == "mod" => {
                pending_mod = ident(toks.get(i + 1)).map(str::to_string);
                if let Some(name) = &pending_mod
                    && in_test
                    && is(toks.get(i + 2), &Tok::Punct(';'))
                {
                    let mut m: Vec<String> = within();
                    m.push(name.clone());
                    test_mods.push(m);
                }
                i += 2;
            }
            Tok::Ident(w) if w == "use" => {
                let mut leaves = Vec::new();
                i += 1;
                use_tree(&toks, &mut i, Vec::new(), &mut leaves);
                if !in_test {
                    let within: Vec<String> = within();
                    out.extend(leaves.into_iter().map(|(segments, line)| Named {
                        within: within.clone(),
                        segments,
                        line,
                    }));
                }
            }
            Tok::Ident(w)
                if matches!(w.as_str(), "crate" | "super" | "self")
                    && is(toks.get(i + 1), &Tok::Colons)
                    && !(i > 0 && is(toks.get(i - 1), &Tok::Punct('$')))
                    && !(i > 0 && is(toks.get(i - 1), &Tok::Colons)) =>
            {
                let line = toks[i].1;
                let mut segments = vec![w.clone()];
                i += 1;
                while is(toks.get(i), &Tok::Colons) {
                    let Some(next) = ident(toks.get(i + 1)) else {
                        break;
                    };
                    segments.push(next.to_string());
                    i += 2;
                }
                if !in_test {
                    out.push(Named {
                        within: within(),
                        segments,
                        line,
                    });
                }
            }
            Tok::Punct('{') => {
                frames.push((pending_mod.take(), in_test));
                pending_test = false;
                i += 1;
            }
            Tok::Punct('}') => {
                frames.pop();
                pending_test = false;
                pending_mod = None;
                i += 1;
            }
            Tok::Punct(';') => {
                pending_test = false;
                pending_mod = None;
                i += 1;
            }
            _ => i += 1,
        }
    }
    (out, test_mods)
}

/// Reads one `use` tree from `toks[*i]` on (after `use`, or inside a group), pushing each leaf
/// path with its line to `out`: `a::{b, c::{d, self}}` gives `a::b`, `a::c::d` and `a::c`; a
/// glob gives the path before it. Leaves `*i` after the tree.
fn use_tree(
    toks: &[(Tok, usize)],
    i: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, usize)>,
) {
    let mut segs = prefix;
    while let Some((tok, line)) = toks.get(*i) {
        match tok {
            Tok::Ident(name) if name == "self" && !segs.is_empty() => {
                *i += 1;
                skip_rename(toks, i);
                out.push((segs, *line));
                return;
            }
            Tok::Ident(name) => {
                segs.push(name.clone());
                *i += 1;
                if is(toks.get(*i), &Tok::Colons) {
                    *i += 1;
                    continue;
                }
                skip_rename(toks, i);
                out.push((segs, *line));
                return;
            }
            Tok::Colons => {
                // A leading `::`: an external crate.
                if segs.is_empty() {
                    segs.push("::".to_string());
                }
                *i += 1;
            }
            Tok::Punct('{') => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        None => return,
                        Some((Tok::Punct('}'), _)) => {
                            *i += 1;
                            return;
                        }
                        Some((Tok::Punct(','), _)) => *i += 1,
                        Some(_) => {
                            let before = *i;
                            use_tree(toks, i, segs.clone(), out);
                            if *i == before {
                                *i += 1;
                            }
                        }
                    }
                }
            }
            Tok::Punct('*') => {
                *i += 1;
                out.push((segs, *line));
                return;
            }
            _ => return,
        }
    }
}

fn skip_rename(toks: &[(Tok, usize)], i: &mut usize) {
    if ident(toks.get(*i)) == Some("as") {
        *i += 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crate_files(files: &[(&str, &str)]) -> Vec<(String, String)> {
        files
            .iter()
            .map(|(p, t)| (format!("crates/k/src/{p}"), (*t).to_string()))
            .collect()
    }

    #[test]
    fn a_nested_use_tree_gives_every_leaf_with_its_line() {
        let code =
            "use crate::a::{b::{c, d as e}, self};\nuse super::{\n    f::g,\n    h::*,\n};\n";
        let got: Vec<(String, usize)> = named_paths(code)
            .0
            .into_iter()
            .map(|n| (n.segments.join("::"), n.line))
            .collect();
        assert_eq!(
            got,
            [
                ("crate::a::b::c".to_string(), 1),
                ("crate::a::b::d".to_string(), 1),
                ("crate::a".to_string(), 1),
                ("super::f::g".to_string(), 3),
                ("super::h".to_string(), 4),
            ]
        );
    }

    #[test]
    fn paths_in_code_count_and_test_code_does_not() {
        let code = "fn f() -> crate::a::T { crate::b::make::<u8>() }\n\
                    macro_rules! m { () => { $crate::z::Q } }\n\
                    #[cfg(test)]\nmod tests { use crate::c::X; fn g() { crate::d::y(); } }\n\
                    #[cfg(test)]\n#[path = \"p_tests.rs\"]\nmod props;\nmod lib_side;\n\
                    mod inner { use super::super::e::F; }\n";
        let (named, test_mods) = named_paths(code);
        let got: Vec<(Vec<String>, String)> = named
            .into_iter()
            .map(|n| (n.within, n.segments.join("::")))
            .collect();
        assert_eq!(
            got,
            [
                (vec![], "crate::a::T".to_string()),
                (vec![], "crate::b::make".to_string()),
                (vec!["inner".to_string()], "super::super::e::F".to_string()),
            ]
        );
        assert_eq!(test_mods, [vec!["props".to_string()]]);
        // `super::super` from `x::inner` (in the file of `x`) is the root.
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_string()).collect::<Vec<_>>();
        assert_eq!(
            resolve(
                &s(&["x"]),
                &s(&["inner"]),
                &s(&["super", "super", "e", "F"])
            ),
            Some(s(&["e", "F"]))
        );
    }

    #[test]
    fn a_cycle_between_siblings_is_found_with_an_edge_each_way() {
        let files = crate_files(&[
            ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
            ("a.rs", "use crate::c::Z;\n\nuse crate::b::{X, Y};\n"),
            ("b/mod.rs", "mod inner;\n"),
            ("b/inner.rs", "fn f() {\n    crate::a::go();\n}\n"),
            ("c.rs", "pub struct Z;\n"),
        ]);
        let found = offences(&files, &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        let f = &found[0];
        assert!(
            f.contains("`a` (crates/k/src/a.rs), `b` (crates/k/src/b/mod.rs)"),
            "{f}"
        );
        assert!(
            f.contains("`a` → `b`: crates/k/src/a.rs:3 names `crate::b::X`"),
            "{f}"
        );
        assert!(
            f.contains("`b` → `a`: crates/k/src/b/inner.rs:2 names `crate::a::go`"),
            "{f}"
        );
        assert!(!f.contains("`c`"), "{f}");
    }

    #[test]
    fn a_cycle_through_a_chain_inside_a_directory_is_one_component() {
        let files = crate_files(&[
            ("lib.rs", "mod d;\n"),
            ("d/mod.rs", "mod x;\nmod y;\nmod z;\n"),
            ("d/x.rs", "use super::y::A;\n"),
            ("d/y.rs", "use crate::d::z::B;\n"),
            ("d/z.rs", "use super::x::C;\n"),
        ]);
        let found = offences(&files, &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("`d::x`") && found[0].contains("`d::z`"));
        assert_eq!(found[0].matches(" → ").count(), 3, "{}", found[0]);
    }

    #[test]
    fn a_parent_and_its_child_naming_each_other_is_nesting() {
        let files = crate_files(&[
            ("lib.rs", "mod p;\npub use p::Thing;\nfn root_item() {}\n"),
            (
                "p/mod.rs",
                "mod child;\npub use self::child::Thing;\npub(crate) struct Shared;\n",
            ),
            (
                "p/child.rs",
                "use super::Shared;\nuse crate::root_item;\npub struct Thing;\n",
            ),
            ("tests.rs", "use crate::p::Thing;\n"),
        ]);
        assert!(offences(&files, &[]).is_empty());
    }

    #[test]
    fn a_file_only_the_tests_declare_makes_no_edge() {
        let files = crate_files(&[
            ("lib.rs", "mod a;\nmod b;\n"),
            ("a.rs", "#[cfg(test)]\nmod props;\npub struct Y;\n"),
            ("a/props.rs", "use crate::b::X;\n"),
            ("b.rs", "use crate::a::Y;\npub struct X;\n"),
        ]);
        assert!(offences(&files, &[]).is_empty());
        let files = crate_files(&[
            ("lib.rs", "mod a;\nmod b;\n"),
            ("a.rs", "mod props;\npub struct Y;\n"),
            ("a/props.rs", "use crate::b::X;\n"),
            ("b.rs", "use crate::a::Y;\npub struct X;\n"),
        ]);
        assert_eq!(offences(&files, &[]).len(), 1);
    }

    #[test]
    fn an_allowed_cycle_passes_and_a_stale_allowance_is_an_offence() {
        let files = crate_files(&[
            ("main.rs", "mod a;\nmod b;\n"),
            ("a.rs", "use crate::b::X;\n"),
            ("b.rs", "use crate::a::Y;\n"),
        ]);
        assert!(offences(&files, &[("k", &["b", "a"])]).is_empty());
        let found = offences(&files, &[("k", &["a", "b"]), ("k", &["a", "c"])]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("a ⇄ c in k, which no longer exists"));
    }
}
