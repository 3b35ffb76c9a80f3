//! The `poolipc` command.
fn main() {}
