//! The `ingest` fuzz target's body (also run by the CI smoke test,
//! `tests/fuzz_smoke.rs`): `DoPut` ingest, whole — a descriptor, a schema
//! message and a record batch message whose flatbuffer headers and body
//! come from the fuzzer, decoded,
//! admitted into the arena and committed, or refused. The input is
//! `[u16 schema header length][schema header][u16 batch header length]
//! [batch header][batch body]` (little-endian lengths). Nothing may panic
//! past the server's own handling, hang, or break the budget.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use arrow_flight::{FlightData, FlightDescriptor};
use bytes::Bytes;
use flightdeck_server::config::ServerConfig;
use flightdeck_server::state::State;
use prost::Message;

struct Harness {
    runtime: tokio::runtime::Runtime,
    state: Arc<State>,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let config = ServerConfig {
            memory_limit: 64 << 20,
            spill_url: Some("memory://".into()),
            use_cuda: false,
            stream_idle_timeout: std::time::Duration::from_secs(5),
            ..ServerConfig::default()
        };
        let state = runtime
            .block_on(State::open(config, "grpc://fuzz".into()))
            .expect("state");
        Harness {
            runtime,
            state: Arc::new(state),
        }
    })
}

/// The next `u16`-prefixed piece of `data`.
fn piece<'a>(data: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (len, rest) = data.split_first_chunk::<2>()?;
    let len = usize::from(u16::from_le_bytes(*len));
    let (piece, rest) = rest.split_at_checked(len)?;
    *data = rest;
    Some(piece)
}

/// Starts the server state the runs share.
pub fn init() {
    let _ = harness();
}

/// Puts the attempt `data` describes, then drops what was stored; whether
/// it was committed.
pub fn run(data: &[u8]) -> bool {
    static ATTEMPT: AtomicU32 = AtomicU32::new(0);
    let mut rest = data;
    let (Some(schema), Some(header)) = (piece(&mut rest), piece(&mut rest)) else {
        return false;
    };
    let h = harness();
    let attempt = ATTEMPT.fetch_add(1, Ordering::Relaxed);
    let put = flightdeck_protos::PutPartition {
        dataset: "fuzz".into(),
        partition: 0,
        attempt,
        ..Default::default()
    }
    .encode_to_vec();
    let messages = vec![
        Ok(FlightData {
            flight_descriptor: Some(FlightDescriptor::new_cmd(put)),
            data_header: Bytes::copy_from_slice(schema),
            ..Default::default()
        }),
        Ok(FlightData {
            data_header: Bytes::copy_from_slice(header),
            data_body: Bytes::copy_from_slice(rest),
            ..Default::default()
        }),
    ];
    let input = futures::stream::iter(messages);
    let committed = h
        .runtime
        .block_on(flightdeck_server::service::do_put(&h.state, input))
        .is_ok();
    let _ = h.state.catalog().drop_dataset("fuzz");
    assert!(
        h.state.arena().budget().used() <= 64 << 20,
        "the budget holds"
    );
    committed
}
