fn main() -> std::process::ExitCode {
    tollgate_sidecar::cli::main()
}
