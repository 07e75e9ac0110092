//! Compiles `flightdeck.proto` with protox (a pure-Rust protobuf compiler), so
//! building needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=flightdeck.proto");
    let fds = protox::compile(["flightdeck.proto"], ["."])?;
    prost_build::Config::new().bytes(["."]).compile_fds(fds)?;
    Ok(())
}
