//! The public API of each library crate, listed from its sources (`syn`), and a snapshot of it
//! in `xtask/public-api/<crate>.txt` that the tidy check compares: the surface cannot grow or
//! change unnoticed. `cargo xtask public-api` prints the counts; `cargo xtask public-api --bless`
//! writes the snapshots again after a deliberate change (review the diff).
//!
//! What counts as an item: every `pub` item reachable through `pub` modules from the crate's
//! root (functions, types, traits, constants, statics, modules, macros), every name a `pub use`
//! there re-exports, and the `pub` methods and associated constants of inherent `impl`s (and
//! the methods of public traits) of a type so exported, wherever the `impl` is. Items behind
//! `#[cfg(feature = "x")]` are listed with `[feature x]`; `#[cfg(test)]` ones are not listed.
//! A listing from source, not rustdoc's (`cargo public-api` needs a nightly toolchain): it does
//! not resolve re-exports' targets, so a re-export counts once under its own name.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The library crates whose surface is snapshotted: (name, root source file).
pub(crate) const CRATES: &[(&str, &str)] = &[
    ("poolipc", "crates/poolipc/src/lib.rs"),
    ("poolipc-types", "crates/poolipc-types/src/lib.rs"),
    ("poolipc-driver", "crates/poolipc-driver/src/lib.rs"),
    ("poolipc-pool", "crates/poolipc-pool/src/lib.rs"),
    ("poolipc-contract", "crates/poolipc-contract/src/lib.rs"),
    ("poolipc-transport", "crates/poolipc-transport/src/lib.rs"),
    ("poolipc-mps", "crates/poolipc-mps/src/lib.rs"),
];

/// Test and bench scaffolding: (crate, item) that may be public only behind a feature.
pub(crate) const SCAFFOLDING: &[(&str, &str)] = &[
    ("poolipc", "failpoint (fn)"),
    ("poolipc", "FAILPOINT_ENV (use)"),
    ("poolipc", "canary (mod)"),
    ("poolipc-contract", "sim (mod)"),
    ("poolipc-contract", "audit (mod)"),
    ("poolipc-contract", "typestate (mod)"),
];

/// Where the snapshots live.
pub(crate) const SNAPSHOTS: &str = "xtask/public-api";

/// The listed public items of the crate whose root is `lib`, sorted.
pub(crate) fn list(lib: &Path) -> Result<Vec<String>> {
    let mut w = Walk::default();
    w.module(lib, &[], true, None)?;
    let exported: HashSet<&str> = w.names.iter().map(String::as_str).collect();
    let mut items = w.items.clone();
    for (ty, line) in &w.impls {
        if exported.contains(ty.as_str()) {
            items.insert(format!("{ty}::{line}"));
        }
    }
    Ok(items.into_iter().collect())
}

fn prefix(path: &[String]) -> String {
    path.iter().map(|p| format!("{p}::")).collect()
}

#[derive(Default)]
struct Walk {
    /// The listed items.
    items: BTreeSet<String>,
    /// The last segment of every public name (to keep the methods of exported types).
    names: HashSet<String>,
    /// (type, "method (fn)") of every inherent impl's public item, anywhere (listed under the
    /// type's name alone: the module an `impl` sits in is not the type's path).
    impls: Vec<(String, String)>,
}

/// `Some(feature)` for `#[cfg(feature = "x")]`, `None` for no cfg (or `cfg(not(..))`, the
/// default build's side); `Err(())` for `#[cfg(test)]`-like cfgs: not listed.
fn gate(attrs: &[syn::Attribute]) -> Result<Option<String>, ()> {
    for a in attrs {
        if !a.path().is_ident("cfg") {
            continue;
        }
        let Ok(meta) = a.parse_args::<syn::Meta>() else {
            continue;
        };
        match &meta {
            syn::Meta::Path(p) if p.is_ident("test") => return Err(()),
            syn::Meta::NameValue(nv) if nv.path.is_ident("feature") => {
                if let syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) = &nv.value
                {
                    return Ok(Some(s.value()));
                }
            }
            syn::Meta::List(l) if l.path.is_ident("any") || l.path.is_ident("all") => {
                let text = l.tokens.to_string();
                if text.contains("test") && !text.contains("feature") {
                    return Err(());
                }
                if let Some(f) = text.split('"').nth(1) {
                    return Ok(Some(f.to_string()));
                }
            }
            _ => {}
        }
    }
    Ok(None)
}

fn is_pub(v: &syn::Visibility) -> bool {
    matches!(v, syn::Visibility::Public(_))
}

impl Walk {
    /// Walks the module in `file` at `path`; `public`: whether it is reachable publicly.
    fn module(
        &mut self,
        file: &Path,
        path: &[String],
        public: bool,
        feature: Option<String>,
    ) -> Result<()> {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let parsed =
            syn::parse_file(&text).with_context(|| format!("parsing {}", file.display()))?;
        // Submodules of `lib.rs`/`mod.rs` sit beside it; those of `x.rs` in `x/`.
        let dir = match file.file_name().and_then(|n| n.to_str()) {
            Some("lib.rs" | "mod.rs" | "main.rs") => file.parent().map(Path::to_path_buf),
            _ => file
                .parent()
                .map(|p| p.join(file.file_stem().unwrap_or_default())),
        }
        .unwrap_or_default();
        self.items_of(&parsed.items, &dir, path, public, feature)
    }

    fn items_of(
        &mut self,
        items: &[syn::Item],
        dir: &Path,
        path: &[String],
        public: bool,
        feature: Option<String>,
    ) -> Result<()> {
        for item in items {
            let (attrs, vis, name, kind) = match item {
                syn::Item::Fn(i) => (&i.attrs, &i.vis, i.sig.ident.to_string(), "fn"),
                syn::Item::Struct(i) => (&i.attrs, &i.vis, i.ident.to_string(), "struct"),
                syn::Item::Enum(i) => (&i.attrs, &i.vis, i.ident.to_string(), "enum"),
                syn::Item::Union(i) => (&i.attrs, &i.vis, i.ident.to_string(), "union"),
                syn::Item::Trait(i) => (&i.attrs, &i.vis, i.ident.to_string(), "trait"),
                syn::Item::Type(i) => (&i.attrs, &i.vis, i.ident.to_string(), "type"),
                syn::Item::Const(i) => (&i.attrs, &i.vis, i.ident.to_string(), "const"),
                syn::Item::Static(i) => (&i.attrs, &i.vis, i.ident.to_string(), "static"),
                syn::Item::Mod(m) => {
                    let Ok(gated) = gate(&m.attrs) else { continue };
                    let feature = gated.or_else(|| feature.clone());
                    let name = m.ident.to_string();
                    let public = public && is_pub(&m.vis);
                    let mut sub = path.to_vec();
                    sub.push(name.clone());
                    if public {
                        self.add(path, &name, "mod", feature.as_deref());
                    }
                    match &m.content {
                        Some((_, inner)) => {
                            self.items_of(inner, &dir.join(&name), &sub, public, feature)?;
                        }
                        None => {
                            let flat = dir.join(format!("{name}.rs"));
                            let nested = dir.join(&name).join("mod.rs");
                            let file = if flat.exists() { flat } else { nested };
                            if !file.exists() {
                                bail!("module `{name}` in {}: no file", dir.display());
                            }
                            self.module(&file, &sub, public, feature)?;
                        }
                    }
                    continue;
                }
                syn::Item::Use(u) => {
                    let Ok(gated) = gate(&u.attrs) else { continue };
                    if public && is_pub(&u.vis) {
                        let feature = gated.or_else(|| feature.clone());
                        let mut leaves = Vec::new();
                        use_leaves(&u.tree, &mut leaves);
                        for leaf in leaves {
                            self.add(path, &leaf, "use", feature.as_deref());
                        }
                    }
                    continue;
                }
                syn::Item::Impl(i) => {
                    if gate(&i.attrs).is_err() || i.trait_.is_some() {
                        continue;
                    }
                    let syn::Type::Path(tp) = &*i.self_ty else {
                        continue;
                    };
                    let Some(ty) = tp.path.segments.last().map(|s| s.ident.to_string()) else {
                        continue;
                    };
                    for ii in &i.items {
                        let (attrs, label) = match ii {
                            syn::ImplItem::Fn(f) if is_pub(&f.vis) => {
                                (&f.attrs, format!("{} (fn)", f.sig.ident))
                            }
                            syn::ImplItem::Const(c) if is_pub(&c.vis) => {
                                (&c.attrs, format!("{} (const)", c.ident))
                            }
                            _ => continue,
                        };
                        let Ok(gated) = gate(attrs) else { continue };
                        let g = gated.or_else(|| feature.clone());
                        let entry = with_feature(label, g.as_deref());
                        self.impls.push((ty.clone(), entry));
                    }
                    continue;
                }
                syn::Item::Macro(m) => {
                    let exported = m.attrs.iter().any(|a| a.path().is_ident("macro_export"));
                    if let (true, Some(ident)) = (exported, &m.ident) {
                        // `#[macro_export]` puts it at the crate's root.
                        self.add(&[], &ident.to_string(), "macro", feature.as_deref());
                    }
                    continue;
                }
                _ => continue,
            };
            let Ok(gated) = gate(attrs) else { continue };
            if !(public && is_pub(vis)) {
                continue;
            }
            let feature = gated.or_else(|| feature.clone());
            self.add(path, &name, kind, feature.as_deref());
            if let syn::Item::Trait(t) = item {
                for ti in &t.items {
                    if let syn::TraitItem::Fn(f) = ti {
                        if gate(&f.attrs).is_err() {
                            continue;
                        }
                        self.items.insert(with_feature(
                            format!("{}{name}::{} (trait fn)", prefix(path), f.sig.ident),
                            feature.as_deref(),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn add(&mut self, path: &[String], name: &str, kind: &str, feature: Option<&str>) {
        let last = name.rsplit("::").next().unwrap_or(name).to_string();
        self.names.insert(last);
        self.items.insert(with_feature(
            format!("{}{name} ({kind})", prefix(path)),
            feature,
        ));
    }
}

fn with_feature(s: String, feature: Option<&str>) -> String {
    match feature {
        Some(f) => format!("{s} [feature {f}]"),
        None => s,
    }
}

/// The names a `use` tree brings in: `a::b::{c, d as e}` gives `c` and `e`; a glob gives
/// `a::b::*`.
fn use_leaves(tree: &syn::UseTree, out: &mut Vec<String>) {
    fn walk(tree: &syn::UseTree, at: &str, out: &mut Vec<String>) {
        match tree {
            syn::UseTree::Path(p) => walk(&p.tree, &format!("{at}{}::", p.ident), out),
            syn::UseTree::Name(n) => out.push(n.ident.to_string()),
            syn::UseTree::Rename(r) => out.push(r.rename.to_string()),
            syn::UseTree::Glob(_) => out.push(format!("{at}*")),
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| walk(t, at, out)),
        }
    }
    walk(tree, "", out);
}

fn snapshot_path(root: &Path, krate: &str) -> PathBuf {
    root.join(SNAPSHOTS).join(format!("{krate}.txt"))
}

/// Compares each crate's listing with its snapshot (or, with `bless`, writes the snapshots);
/// returns (crate, item count) for each.
pub(crate) fn check(root: &Path, bless: bool) -> Result<Vec<(&'static str, usize)>> {
    let mut counts = Vec::new();
    let mut differ = Vec::new();
    for (krate, lib) in CRATES {
        let items = list(&root.join(lib))?;
        counts.push((*krate, items.len()));
        for (k, bare) in SCAFFOLDING.iter().filter(|(k, _)| k == krate) {
            if items.iter().any(|i| i == bare) {
                differ.push(format!(
                    "{k}: `{bare}` is test scaffolding in the public API: put it behind the `testing` feature"
                ));
            }
        }
        let text = items.join("\n") + "\n";
        let snap = snapshot_path(root, krate);
        if bless {
            std::fs::create_dir_all(root.join(SNAPSHOTS))?;
            std::fs::write(&snap, &text)?;
            continue;
        }
        let old = std::fs::read_to_string(&snap).unwrap_or_default();
        if old != text {
            let was: BTreeSet<&str> = old.lines().collect();
            let now: BTreeSet<&str> = text.lines().collect();
            let mut d = format!("{krate}: the public API changed:");
            for added in now.difference(&was) {
                d.push_str(&format!("\n  + {added}"));
            }
            for gone in was.difference(&now) {
                d.push_str(&format!("\n  - {gone}"));
            }
            differ.push(d);
        }
    }
    if !differ.is_empty() {
        bail!(
            "{}\nIf that is meant, `cargo xtask public-api --bless` writes {SNAPSHOTS}/ again; commit it with the change.",
            differ.join("\n")
        );
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(src: &str) -> Vec<String> {
        let dir = std::env::temp_dir().join(format!("poolipc-public-api-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("inner")).unwrap();
        std::fs::write(
            dir.join("inner.rs"),
            "pub struct Deep; impl Deep { pub fn go(&self) {} fn hidden(&self) {} }\n",
        )
        .unwrap();
        std::fs::write(dir.join("lib.rs"), src).unwrap();
        let out = list(&dir.join("lib.rs")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        out
    }

    #[test]
    fn lists_public_items_reexports_methods_and_features() {
        let src = "mod inner;\npub use inner::Deep;\npub fn f() {}\nfn g() {}\npub(crate) fn h() {}\n\
                   #[cfg(feature = \"testing\")]\npub mod scaffold { pub fn poke() {} }\n\
                   #[cfg(test)]\npub mod t { pub fn x() {} }\n\
                   pub trait T { fn m(&self); }\npub struct S { pub a: u8 }\nimpl S { pub fn new() -> S { S { a: 0 } } fn private() {} }\n";
        let items = listed(src);
        assert_eq!(
            items,
            vec![
                "Deep (use)",
                "Deep::go (fn)",
                "S (struct)",
                "S::new (fn)",
                "T (trait)",
                "T::m (trait fn)",
                "f (fn)",
                "scaffold (mod) [feature testing]",
                "scaffold::poke (fn) [feature testing]",
            ],
            "{items:#?}"
        );
    }

    #[test]
    fn the_snapshots_match_the_sources() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root");
        check(root, false).expect("public API");
    }
}
