//! The opaque byte strings the driver writes and the other process reads.

use std::fmt;

macro_rules! blob {
    ($(#[$doc:meta])* $name:ident, $len:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(pub [u8; $len]);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "("))?;
                for b in &self.0[..8] {
                    write!(f, "{b:02x}")?;
                }
                write!(f, "..)")
            }
        }
    };
}

blob!(
    /// A pointer export (`CUmemPoolPtrExportData`, what `cuMemPoolExportPointer` writes):
    /// 64 opaque bytes.
    ExportBlob,
    64
);
blob!(
    /// An interprocess event handle (`CUipcEventHandle`, what `cuIpcGetEventHandle` writes):
    /// 64 opaque bytes.
    EventBlob,
    64
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_debugs_as_its_first_eight_bytes() {
        let mut b = [0u8; 64];
        b[0] = 0xab;
        b[9] = 0xff;
        assert_eq!(
            format!("{:?}", ExportBlob(b)),
            "ExportBlob(ab00000000000000..)"
        );
        assert_eq!(
            format!("{:?}", EventBlob(b)),
            "EventBlob(ab00000000000000..)"
        );
    }
}
