//! The `commands` fuzz target's body (also run by the CI smoke test,
//! `tests/fuzz_smoke.rs`): everything a client's bytes are decoded as before
//! any state is touched — put and read descriptors, tickets, every action
//! body, commit markers, and the `DoGet` edge's request framing. None may
//! panic; every refusal is an error value.

use arrow_flight::FlightDescriptor;
use flightdeck_server::config::ServerConfig;
use flightdeck_server::convert;

/// Decodes `data` every way a client's bytes are decoded.
pub fn run(data: &[u8]) {
    let config = ServerConfig::default();
    let descriptor = FlightDescriptor::new_cmd(data.to_vec());
    let _ = convert::put_target(&descriptor);
    let _ = convert::read_plan(&descriptor, &config);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = convert::read_plan(&FlightDescriptor::new_path(vec![text.to_string()]), &config);
        let _ = convert::dataset_name(text);
    }
    let _ = convert::decode_ticket(data, &config);
    let _ = convert::put_commit(data);
    let _ = convert::seal_request(data);
    let _ = convert::prepare_request(data);
    let _ = convert::commit_request(data);
    let _ = convert::drop_request(data);
    let _ = convert::describe_request(data);
    let _ = convert::place_request(data);
    let _ = convert::evict_request(data);
    let _ = convert::train_job(data, &config);
    let _ = convert::job_query(data);
    let _ = convert::schema_from_ipc(data, "fuzz");
    let _ = flightdeck_server::service::parse_ticket_request(data);
}
