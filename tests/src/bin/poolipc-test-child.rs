//! The second process of poolipc's multi-process tests; see `poolipc_tests::child`.

fn main() -> std::process::ExitCode {
    match poolipc_tests::child::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("poolipc-test-child: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
