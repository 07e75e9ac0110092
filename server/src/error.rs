//! The server's error type and its one mapping to gRPC status codes.
//!
//! Every failure a client can cause ends up here with a message that names the
//! dataset, partition or column at fault and says what the caller can do. The
//! mapping to `tonic::Status` is deliberate, variant by variant; `Internal` is
//! for bugs only.

use tonic::{Code, Status};

/// Result with the server's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which partitions a seal found without a committed attempt, in words:
/// `partition 1 has`, or `3 partitions have … (the first: [..])`.
fn missing_text(count: u64, first: &[u32]) -> String {
    match first {
        [one] if count == 1 => format!("partition {one} has no committed attempt"),
        _ if count == first.len() as u64 => {
            format!("partitions {first:?} have no committed attempt")
        }
        _ => format!("{count} partitions have no committed attempt (the first: {first:?})"),
    }
}

/// Everything that can go wrong serving a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The request is malformed: a bad command, ticket, column or argument.
    #[error("{0}")]
    InvalidArgument(String),

    /// No dataset of this name exists.
    #[error(
        "dataset '{dataset}' does not exist; write it with DoPut, or list datasets with ListFlights"
    )]
    DatasetNotFound {
        /// The dataset asked for.
        dataset: String,
    },

    /// The attempt was committed before; attempts are immutable.
    #[error(
        "attempt {attempt} of partition {partition} of dataset '{dataset}' is already committed; \
         retry with a new attempt number"
    )]
    AttemptExists {
        /// Dataset of the attempt.
        dataset: String,
        /// Partition of the attempt.
        partition: u32,
        /// The attempt number.
        attempt: u32,
    },

    /// The dataset is sealed and cannot take more partitions.
    #[error(
        "dataset '{dataset}' is sealed and accepts no more partitions; to overwrite it, write the \
         new rows as a replacing write (PutPartition.replace; mode(\"overwrite\") in Spark), or \
         drop it and write it again"
    )]
    DatasetSealed {
        /// The sealed dataset.
        dataset: String,
    },

    /// The dataset is still open and cannot be read yet.
    #[error("dataset '{dataset}' is not sealed yet; seal it (action 'seal') before reading")]
    DatasetNotSealed {
        /// The open dataset.
        dataset: String,
    },

    /// Seal found partitions missing.
    #[error(
        "cannot seal dataset '{dataset}': expected {expected} partitions but {}; write them, or \
         seal with the right partition count",
        missing_text(*count, missing)
    )]
    MissingPartitions {
        /// The dataset being sealed.
        dataset: String,
        /// Expected partition count.
        expected: u32,
        /// The first (at most [`MISSING_SHOWN`]) partitions without a
        /// committed attempt.
        missing: Vec<u32>,
        /// How many partitions have no committed attempt.
        count: u64,
    },

    /// What the request would create exists (other than an attempt).
    #[error("{0}")]
    AlreadyExists(String),

    /// The request needs a state the server is not in (other than the above).
    #[error("{0}")]
    FailedPrecondition(String),

    /// The memory budget cannot hold the request.
    #[error("{0}")]
    ResourceExhausted(String),

    /// The client went away or broke its stream; nothing was stored.
    #[error("{0}")]
    Aborted(String),

    /// The operation is not offered by this server.
    #[error("{0}")]
    Unimplemented(String),

    /// Something other than a dataset that the request names does not exist.
    #[error("{0}")]
    NotFound(String),

    /// The spill or persistence store failed (I/O, network, credentials);
    /// retrying may work once the store is reachable.
    #[error("{0}")]
    Unavailable(String),

    /// A dataset's stored copy (spilled or persisted) is gone or damaged:
    /// no retry brings it back.
    #[error("{0}")]
    DataLoss(String),

    /// The call carries no token, or one this server does not accept.
    #[error("{0}")]
    Unauthenticated(String),

    /// The caller's role may not make the call, or the request names
    /// something the server may not touch (a checkpoint outside
    /// `--checkpoint-root` and the allowed prefixes).
    #[error("{0}")]
    PermissionDenied(String),

    /// A bug: an invariant of the server does not hold.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// A malformed request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidArgument(message.into())
    }

    /// The gRPC code this error travels with.
    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument(_) => Code::InvalidArgument,
            Self::DatasetNotFound { .. } | Self::NotFound(_) => Code::NotFound,
            Self::AttemptExists { .. } | Self::AlreadyExists(_) => Code::AlreadyExists,
            Self::DatasetSealed { .. }
            | Self::DatasetNotSealed { .. }
            | Self::MissingPartitions { .. }
            | Self::FailedPrecondition(_) => Code::FailedPrecondition,
            Self::ResourceExhausted(_) => Code::ResourceExhausted,
            Self::Aborted(_) => Code::Aborted,
            Self::Unimplemented(_) => Code::Unimplemented,
            Self::Unavailable(_) => Code::Unavailable,
            Self::DataLoss(_) => Code::DataLoss,
            Self::PermissionDenied(_) => Code::PermissionDenied,
            Self::Unauthenticated(_) => Code::Unauthenticated,
            Self::Internal(_) => Code::Internal,
        }
    }
}

/// How many missing partitions an error names.
pub const MISSING_SHOWN: usize = 16;

/// The longest message a status carries: messages travel in the
/// `grpc-message` header, and names a client sent (columns, datasets) can be
/// of any length.
pub const MAX_MESSAGE_BYTES: usize = 2048;

/// `message`, cut to at most `max` bytes (on a character boundary) with a
/// note of how much was left out.
pub fn bounded(message: String, max: usize) -> String {
    if message.len() <= max {
        return message;
    }
    let mut end = max;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}… ({} more bytes left out)",
        &message[..end],
        message.len() - end
    )
}

/// The trailer carrying an error's gRPC code as a number: Flight clients
/// that map codes onto Flight's own (Arrow Java's turns
/// `FAILED_PRECONDITION` into `INVALID_ARGUMENT`) read the code sent here.
pub const CODE_TRAILER: &str = "flightdeck-grpc-code";

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let message = crate::catalog::readable(&e.to_string()).into_owned();
        let code = e.code();
        let mut trailers = tonic::metadata::MetadataMap::new();
        trailers.insert(CODE_TRAILER, (code as i32).into());
        Status::with_metadata(code, bounded(message, MAX_MESSAGE_BYTES), trailers)
    }
}

/// The message of a caught panic (empty when it carried none).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_deliberate() {
        let missing = Error::MissingPartitions {
            dataset: "d".into(),
            expected: 4,
            missing: vec![1, 3],
            count: 2,
        };
        let status = Status::from(missing);
        assert_eq!(status.code(), Code::FailedPrecondition);
        // The code also travels as a number in a trailer, for Flight
        // clients that fold it into another.
        let trailer = status.metadata().get(CODE_TRAILER).expect("trailer");
        assert_eq!(trailer.to_str().expect("ascii"), "9");
        assert!(status.message().contains("[1, 3]"), "{}", status.message());
        let long = Status::from(Error::invalid(format!("column '{}'", "é".repeat(1 << 20))));
        assert!(long.message().len() < MAX_MESSAGE_BYTES + 64);
        assert!(
            long.message().ends_with("more bytes left out)"),
            "{}",
            &long.message()[..40]
        );
        assert_eq!(
            Status::from(Error::DatasetNotFound {
                dataset: "x".into()
            })
            .code(),
            Code::NotFound
        );
        assert_eq!(
            Status::from(Error::AttemptExists {
                dataset: "x".into(),
                partition: 1,
                attempt: 0
            })
            .code(),
            Code::AlreadyExists
        );
    }
}
