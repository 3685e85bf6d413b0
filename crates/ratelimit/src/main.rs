fn main() -> std::process::ExitCode {
    tollgate_ratelimit::main()
}
