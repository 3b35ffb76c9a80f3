//! The facade's public surface has a ceiling: its listed public items (as
//! [`crate::public_api::list`] counts them, the listing snapshotted in
//! `xtask/public-api/poolipc.txt`) may not exceed [`FACADE_MAX_ITEMS`].

use std::path::Path;

use anyhow::Result;

/// The most public items the facade (`crates/poolipc`) may list: the count today, lowered as
/// the surface shrinks, so that it can only shrink (the target of 150 is met).
pub(crate) const FACADE_MAX_ITEMS: usize = 147;

/// The facade's root source file.
const FACADE_LIB: &str = "crates/poolipc/src/lib.rs";

/// The offence, if the facade under `root` lists more than `max` public items; and the count.
pub(crate) fn offences(root: &Path, max: usize) -> Result<(Vec<String>, usize)> {
    let count = crate::public_api::list(&root.join(FACADE_LIB))?.len();
    let found = if count > max {
        vec![format!(
            "{FACADE_LIB}: the facade lists {count} public items, over FACADE_MAX_ITEMS = {max} (xtask/src/tidy/facade_size.rs): make an item private or fold it into another"
        )]
    } else {
        Vec::new()
    };
    Ok((found, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_facade_over_its_ceiling_is_an_offence() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root");
        let (found, count) = offences(root, usize::MAX).expect("the facade lists");
        assert!(found.is_empty() && count > 0);
        let (found, _) = offences(root, count - 1).expect("the facade lists");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains(&format!("lists {count} public items")));
        assert!(
            offences(root, count)
                .expect("the facade lists")
                .0
                .is_empty()
        );
    }
}
