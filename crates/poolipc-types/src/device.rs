//! A GPU's stable identity.

use std::fmt;

/// A GPU's stable identity (`cuDeviceGetUuid`). Ordinals differ between processes when
/// `CUDA_VISIBLE_DEVICES` does; UUIDs do not, so the handshake compares these.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DeviceUuid(pub [u8; 16]);

impl fmt::Debug for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceUuid({self})")
    }
}

impl fmt::Display for DeviceUuid {
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi prints it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU-")?;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_displays_as_nvidia_smi_prints_it() {
        let u = DeviceUuid([
            0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x00, 0x11, 0x22, 0x33, 0x44, 0x55,
            0x66, 0x77,
        ]);
        assert_eq!(u.to_string(), "GPU-01234567-89ab-cdef-0011-223344556677");
        assert_eq!(
            format!("{u:?}"),
            "DeviceUuid(GPU-01234567-89ab-cdef-0011-223344556677)"
        );
    }
}
