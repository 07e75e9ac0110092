//! The Flight edge: decodes requests, calls the catalog, sample order and
//! memory budget, encodes replies, and maps every error to its gRPC code.
//!
//! Nothing below this module imports it. Each verb lives in one file:
//! `put` (DoPut), `get` (GetFlightInfo, GetSchema, DoGet, ListFlights),
//! `actions` (DoAction, ListActions); `edge` answers `DoGet` on the wire
//! with bodies `ipc` encodes without copying, and `shm` hands a local
//! reader's batches over in shared memory.

mod actions;
mod edge;
mod get;
mod ipc;
pub mod outbox;
mod put;
pub mod shm;
pub mod sql;

pub use edge::{Edge, parse_ticket_request};
pub use put::do_put;

use std::sync::Arc;

use arrow_flight::flight_service_server::FlightService;
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, stream};
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use crate::convert;
use crate::metrics::{CallDetail, WriteDetail};
use crate::state::State;

/// The flightdeck Flight service; Flight SQL calls go on to [`sql`].
#[derive(Debug, Clone)]
pub struct FlightdeckService {
    state: Arc<State>,
    sql: Arc<sql::SqlService>,
}

impl FlightdeckService {
    /// A service over `state`.
    pub fn new(state: Arc<State>) -> Self {
        let sql = Arc::new(sql::SqlService::new(state.clone()));
        Self { state, sql }
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

    /// With `--auth-token-file`, a handshake that carries a token this
    /// server accepts (the token check runs before any call) is answered
    /// with one empty response: clients that authenticate by handshake
    /// first, such as Arrow Java's Flight SQL JDBC driver given a `token`,
    /// then send the same token on every call. Without tokens there is
    /// nothing to shake hands over.
    async fn handshake(
        &self,
        _request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        if !self.state.credentials.needs_tokens() {
            return Err(Status::unimplemented(
                "Handshake is not used by flightdeck: this server takes no token (it has no \
                 --auth-token-file); call it without one",
            ));
        }
        Ok(Response::new(once(HandshakeResponse::default())))
    }

    async fn list_flights(
        &self,
        request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        let infos = get::list_flights(&self.state, &request.get_ref().expression)?;
        Ok(Response::new(
            stream::iter(infos.into_iter().map(Ok)).boxed(),
        ))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        if sql::is_sql_command(&request.get_ref().cmd) {
            return FlightService::get_flight_info(self.sql.as_ref(), request).await;
        }
        Ok(Response::new(
            get::flight_info(&self.state, request.into_inner()).await?,
        ))
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
        if sql::is_sql_command(&request.get_ref().ticket) {
            return FlightService::do_get(self.sql.as_ref(), request).await;
        }
        Ok(Response::new(
            get::do_get(&self.state, &request.into_inner()).await?,
        ))
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        if request.extensions().get::<edge::SqlPut>().is_some() {
            return FlightService::do_put(self.sql.as_ref(), request).await;
        }
        let ingest = request.extensions().get::<edge::SqlIngest>().is_some();
        let detail = request.extensions().get::<CallDetail>().cloned();
        let written = if ingest {
            self.sql.ingest(request.into_inner()).await
        } else {
            put::receive(&self.state, request.into_inner())
                .await
                .map(|received| {
                    let ack = received.ack().clone();
                    let state = self.state.clone();
                    // Committed as the answer is sent: a call its client
                    // reset before taking it stores nothing.
                    let answer = stream::once(async move {
                        let ack = received.commit(&state)?;
                        Ok(PutResult {
                            app_metadata: ack.encode_to_vec().into(),
                        })
                    })
                    .boxed();
                    (ack, answer)
                })
        };
        let (ack, answer) = written?;
        if let Some(detail) = detail {
            detail.wrote(WriteDetail {
                dataset: ack.dataset,
                partition: ack.partition,
                attempt: ack.attempt,
                rows: ack.rows,
                bytes: ack.bytes,
            });
        }
        Ok(Response::new(answer))
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        // Flight SQL actions read; the edge checked the reader role.
        if sql::is_sql_action(&request.get_ref().r#type) {
            return FlightService::do_action(self.sql.as_ref(), request).await;
        }
        if self.state.credentials.needs_tokens() {
            // The edge checked the token and left its role here.
            let role = request
                .extensions()
                .get::<crate::auth::Role>()
                .copied()
                .ok_or_else(|| Status::internal("the call's role was not checked"))?;
            let kind = &request.get_ref().r#type;
            let need = crate::auth::needed("", Some(kind));
            crate::auth::check(role, need, &format!("action '{kind}'"))?;
        }
        let action = request.into_inner();
        if action.r#type == flightdeck_protos::actions::TRAIN {
            return Ok(Response::new(actions::train(&self.state, &action).await?));
        }
        if action.r#type == flightdeck_protos::actions::DERIVE {
            let req = convert::derive_request(&action.body)?;
            let summary = self.sql.derive(&req).await?;
            let info = convert::dataset_info(&summary)?;
            return Ok(Response::new(once(arrow_flight::Result {
                body: info.encode_to_vec().into(),
            })));
        }
        let body = actions::do_action(&self.state, &action).await?;
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
