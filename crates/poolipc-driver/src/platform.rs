//! Facts about the operating system the driver layer checks before it trusts libcuda.

/// Whether this kernel is WSL2's, judged from `/proc/sys/kernel/osrelease` (or
/// `/proc/version`), which on WSL2 name Microsoft.
#[must_use]
pub fn is_wsl2() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .or_else(|_| std::fs::read_to_string("/proc/version"))
        .unwrap_or_default();
    kernel_release_is_wsl2(&release)
}

/// Whether a kernel release string is WSL2's (`5.15.90.1-microsoft-standard-WSL2`).
#[must_use]
pub fn kernel_release_is_wsl2(release: &str) -> bool {
    let r = release.to_ascii_lowercase();
    r.contains("microsoft") || r.contains("wsl")
}

#[cfg(test)]
mod tests {
    use super::kernel_release_is_wsl2;

    #[rstest::rstest]
    #[case("5.15.90.1-microsoft-standard-WSL2", true)]
    #[case("4.4.0-19041-Microsoft", true)]
    #[case("6.8.0-49-generic", false)]
    #[case("6.18.44-fc-v236-gpu", false)]
    #[case("", false)]
    fn wsl2_is_recognised_from_the_kernel_release(#[case] release: &str, #[case] wsl: bool) {
        assert_eq!(kernel_release_is_wsl2(release), wsl);
    }
}
