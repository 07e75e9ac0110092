//! Compiles `flightdeck.proto` with protox (a pure-Rust protobuf compiler), so
//! building needs no `protoc`. The replies the command line prints derive
//! `serde::Serialize` for its `--json` output (IPC schema bytes left out:
//! the command line prints them as fields).

/// Messages `flightdeck datasets | describe | drop | place | evict | stats |
/// jobs | train --json` print, and the messages inside them.
const PRINTED: &[&str] = &[
    ".flightdeck.v1.DatasetInfo",
    ".flightdeck.v1.PartitionInfo",
    ".flightdeck.v1.DevicePlacement",
    ".flightdeck.v1.ClusterLayout",
    ".flightdeck.v1.ClusterMember",
    ".flightdeck.v1.ServerStats",
    ".flightdeck.v1.StagedWrite",
    ".flightdeck.v1.JobStatus",
    ".flightdeck.v1.TrainProgress",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=flightdeck.proto");
    let fds = protox::compile(["flightdeck.proto"], ["."])?;
    let mut config = prost_build::Config::new();
    config.bytes(["."]);
    for message in PRINTED {
        config.type_attribute(message, "#[derive(serde::Serialize)]");
    }
    for schema in [
        ".flightdeck.v1.DatasetInfo.schema",
        ".flightdeck.v1.ClusterLayout.schema",
    ] {
        config.field_attribute(schema, "#[serde(skip)]");
    }
    config.compile_fds(fds)?;
    Ok(())
}
