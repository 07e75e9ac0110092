//! The Flight edge: decodes requests, calls the catalog, sample order and
//! memory budget, encodes replies, and maps every error to its gRPC code.
//!
//! Nothing below this module imports it. Each verb lives in one file:
//! `put` (DoPut), `get` (GetFlightInfo, GetSchema, DoGet, ListFlights),
//! `actions` (DoAction, ListActions).

mod actions;
mod get;
mod put;

use std::sync::{Arc, Mutex, MutexGuard};

use arrow_flight::flight_service_server::FlightService;
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, stream};
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use crate::catalog::Catalog;
use crate::config::ServerConfig;
use crate::memory::Budget;

/// State shared by all requests of one server.
#[derive(Debug)]
pub struct State {
    catalog: Mutex<Catalog>,
    budget: Arc<Budget>,
    config: ServerConfig,
}

impl State {
    /// Fresh state for `config`.
    pub fn new(config: ServerConfig) -> Self {
        Self {
            catalog: Mutex::new(Catalog::new()),
            budget: Budget::new(config.memory_limit),
            config,
        }
    }

    /// The catalog, locked. Catalog operations do not panic; if one ever did,
    /// the catalog is still consistent (each operation validates before it
    /// mutates), so a poisoned lock is taken over rather than spread.
    fn catalog(&self) -> MutexGuard<'_, Catalog> {
        self.catalog.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The flightdeck Flight service.
#[derive(Debug, Clone)]
pub struct FlightdeckService {
    state: Arc<State>,
}

impl FlightdeckService {
    /// A service over fresh state.
    pub fn new(config: ServerConfig) -> Self {
        Self {
            state: Arc::new(State::new(config)),
        }
    }
}

type Stream<T> = BoxStream<'static, Result<T, Status>>;

fn once<T: Send + 'static>(item: T) -> Stream<T> {
    stream::once(async move { Ok(item) }).boxed()
}

#[tonic::async_trait]
impl FlightService for FlightdeckService {
    type HandshakeStream = Stream<HandshakeResponse>;
    type ListFlightsStream = Stream<FlightInfo>;
    type DoGetStream = Stream<FlightData>;
    type DoPutStream = Stream<PutResult>;
    type DoActionStream = Stream<arrow_flight::Result>;
    type ListActionsStream = Stream<ActionType>;
    type DoExchangeStream = Stream<FlightData>;

    async fn handshake(
        &self,
        _request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        Err(Status::unimplemented(
            "Handshake is not used by flightdeck: no authentication is configured on this server",
        ))
    }

    async fn list_flights(
        &self,
        _request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        let infos = get::list_flights(&self.state)?;
        Ok(Response::new(
            stream::iter(infos.into_iter().map(Ok)).boxed(),
        ))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Ok(Response::new(get::flight_info(
            &self.state,
            request.into_inner(),
        )?))
    }

    async fn poll_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented(
            "PollFlightInfo is not offered: plans are answered at once, use GetFlightInfo",
        ))
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        Ok(Response::new(get::schema(
            &self.state,
            &request.into_inner(),
        )?))
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        Ok(Response::new(get::do_get(
            &self.state,
            &request.into_inner(),
        )?))
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        let ack = put::do_put(&self.state, request.into_inner()).await?;
        Ok(Response::new(once(PutResult {
            app_metadata: ack.encode_to_vec().into(),
        })))
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let body = actions::do_action(&self.state, &request.into_inner())?;
        Ok(Response::new(once(arrow_flight::Result { body })))
    }

    async fn list_actions(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        Ok(Response::new(
            stream::iter(actions::list().into_iter().map(Ok)).boxed(),
        ))
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented(
            "DoExchange is not offered: write with DoPut and read with DoGet",
        ))
    }
}
