//! Wire messages of the flightdeck protocol, package `flightdeck.v1`.
//!
//! Generated at build time from `protos/flightdeck.proto`, the public contract:
//! every command, ticket, action body and reply that travels inside Arrow Flight
//! messages. Wire types stay at the edge; the server converts them to its
//! domain types in one place (`flightdeck_server::convert`).

#![allow(missing_docs)]

/// Messages of package `flightdeck.v1`.
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/flightdeck.v1.rs"));
}

pub use v1::*;

/// Action type names of `DoAction`.
pub mod actions {
    /// Seal a dataset: body `SealDataset`, result `DatasetInfo`.
    pub const SEAL: &str = "seal";
    /// Drop a dataset: body `DropDataset`, result `DatasetInfo`.
    pub const DROP: &str = "drop";
    /// Describe a dataset: body `DescribeDataset`, result `DatasetInfo`.
    pub const DESCRIBE: &str = "describe";
    /// Server statistics: empty body, result `ServerStats`.
    pub const STATS: &str = "stats";
    /// `PlaceColumns` -> `DatasetInfo`: copy numeric columns to GPUs.
    pub const PLACE: &str = "place";
    /// `EvictColumns` -> `DatasetInfo`: free a dataset's GPU copies.
    pub const EVICT: &str = "evict";
    /// `TrainJob` -> a stream of `TrainProgress`: run a training job.
    pub const TRAIN: &str = "train";
    /// `JobQuery` -> `JobList`: status of training jobs.
    pub const JOB: &str = "job";
    /// `PrepareMember` -> `MemberPrepared`: seal this member's part of a
    /// cluster dataset (sent between members).
    pub const MEMBER_PREPARE: &str = "member_prepare";
    /// `CommitLayout` -> `DatasetInfo`: adopt a cluster layout (sent between
    /// members).
    pub const MEMBER_COMMIT: &str = "member_commit";
    /// `SelectRows` -> `SelectedRows`: rows a read-plan filter selects in
    /// each of this member's partitions (sent between members).
    pub const MEMBER_SELECT: &str = "member_select";
    /// `DeriveDataset` -> `DatasetInfo`: keep a SQL query's result as a new
    /// sealed dataset.
    pub const DERIVE: &str = "derive";
}

/// The proto source, for clients that compile it themselves.
pub const PROTO_SOURCE: &str = include_str!("../flightdeck.proto");
