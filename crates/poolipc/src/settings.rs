//! What this process's sides can do and the environment they read: the capabilities said in
//! the handshake ([`capabilities`]) and the numbers environment variables hold
//! ([`env_number`]). A leaf: it imports nothing of the crate's.

use poolipc_driver::Driver;
use poolipc_transport::Capabilities;

/// What the facade's sides can do on any device, said in the handshake.
pub(crate) const CAPABILITIES: Capabilities = Capabilities(
    Capabilities::POOL_POINTER.0 | Capabilities::IPC_EVENTS.0 | Capabilities::HOST_STAGING.0,
);

/// What an isolated worker ([`Trust::Isolated`](crate::Trust::Isolated)) is not offered and
/// does not claim: pool pointers and VMM handles, each a handle on the parent's memory beyond
/// the tensors lent.
pub(crate) const PARENT_MEMORY_HANDLES: Capabilities =
    Capabilities(Capabilities::POOL_POINTER.0 | Capabilities::VMM_HANDLE.0);

/// What this side can do on `device`: [`CAPABILITIES`], and the result arena
/// ([`Capabilities::VMM_ARENA`]) and VMM allocations lent by handle
/// ([`Capabilities::VMM_HANDLE`]) where the device has VMM with POSIX FD handles.
pub(crate) fn capabilities(driver: &dyn Driver, device: u32) -> Capabilities {
    match driver.device_info(device) {
        Ok(info) if info.vmm && info.vmm_posix_fd => {
            CAPABILITIES | Capabilities::VMM_ARENA | Capabilities::VMM_HANDLE
        }
        _ => CAPABILITIES,
    }
}

/// The number environment variable `name` holds, if it is set; one that is set to something
/// else is ignored with a warning naming it (the default applies), not taken for unset
/// silently.
pub(crate) fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    let value = std::env::var_os(name)?;
    let parsed = parse_env_number(value.to_str());
    // Once per variable: defaults are made more than once (every `ParentOptions`).
    static WARNED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let first = || {
        let mut warned = WARNED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let new = !warned.iter().any(|w| w == name);
        if new {
            warned.push(name.to_owned());
        }
        new
    };
    if parsed.is_none() && first() {
        tracing::warn!(
            "{name}={value:?} is not a whole number: ignored, the default applies",
            value = value.to_string_lossy()
        );
    }
    parsed
}

/// [`env_number`]'s reading of a value that is set (None: not valid UTF-8).
fn parse_env_number<T: std::str::FromStr>(value: Option<&str>) -> Option<T> {
    value.and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::parse_env_number;

    #[test]
    fn an_environment_number_is_read_trimmed_and_anything_else_is_none() {
        assert_eq!(parse_env_number::<u64>(Some("400")), Some(400));
        assert_eq!(parse_env_number::<usize>(Some(" 4\n")), Some(4));
        assert_eq!(parse_env_number::<u64>(Some("four")), None);
        assert_eq!(parse_env_number::<u64>(Some("-1")), None);
        assert_eq!(parse_env_number::<u64>(Some("")), None);
        assert_eq!(parse_env_number::<u64>(None), None, "not valid UTF-8");
    }
}
