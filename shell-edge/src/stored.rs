//! The HTTP side of durable responses (SPEC §6): a durable run request,
//! and the routes that fetch, resume, cancel and delete stored responses.
//!
//! A run request is durable when it asks to be kept (`store`, `background`)
//! or sends an `Idempotency-Key`. Its record is created first (R-IDEM-1: a
//! repeat of the same request finds the record and runs nothing), its run
//! writes the journal ([`crate::driver::spawn_durable`]), and its answer,
//! like every later read of it, follows the journal
//! ([`crate::durable::Follower`]): the API's own encoder renders the
//! record's events from the first one, so a resumed stream continues the
//! very stream the client had (R-JRN-2). SSE events are numbered with `id:`
//! lines ([`framing::SseNumbering`]); a client resumes after the last one it
//! has with `starting_after=N` or `Last-Event-ID: N`.
//!
//! | route | what |
//! | --- | --- |
//! | `GET /v1/responses/{id}` | the response object now; `?stream=true[&starting_after=N]` replays then follows |
//! | `POST /v1/responses/{id}/cancel` | cancel a running response; the object |
//! | `DELETE /v1/responses/{id}` | cancel if running, then remove |
//! | `GET /v1/responses/{id}/input_items` | the request's input items (`order`, `limit`, `after`) |
//! | `GET /v1/chat/completions/{id}` | a stored completion; `?stream=true` resumes (iop extension) |
//! | `DELETE /v1/chat/completions/{id}` | remove it |

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::stream::BoxStream;
use iop_core::edge::client_ids;
use iop_core::edge::durable::{JournalSpec, ended_before_commit, failure_of};
use iop_core::edge::request::Delivery;
use iop_core::edge::whole_answer::WholeAnswerBudget;
use iop_core::ids::ProviderId;
use iop_core::journal::{
    CreateOutcome, JournalApi, JournalError, MAX_CONVERSATION_LINKS, NewRecord, RecordMeta,
    RecordStatus, Terminal, fingerprint, idempotency_hash,
};
use iop_wire::{ChatMessage, RunApi};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::admit::Admitted;
use crate::answer_body::{AnswerSource, Step, answer_body};
use crate::api::endpoint::{
    AnswerStart, AnswerStream, ChatCompletions, Completions, Keep, Messages, Ollama, Responses,
    RunEndpoint, WholeAnswer,
};
use crate::api::{ApiError, framing, ids};
use crate::app_state::{AppState, authenticate};
use crate::config::ApiKey;
use crate::driver::{self, DurableRun, Work};
use crate::durable::{Followed, Follower, StoredRequest};
use crate::in_flight::RequestView;
use crate::request_record::RequestRecord;

pub use iop_core::edge::client_ids::MAX_IDEMPOTENCY_KEY_CHARS;

/// The `Idempotency-Key` header, if sent: 1 to 255 visible ASCII
/// characters (R-LIM-5).
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|k| client_ids::idempotency_key_ok(k))
        .ok_or_else(|| {
            ApiError::invalid_value(
                "Idempotency-Key",
                "must be 1 to 255 visible ASCII characters.",
            )
        })?;
    Ok(Some(key.to_owned()))
}

/// The error a journal refusal is answered with.
fn journal_error(e: &JournalError) -> ApiError {
    match e {
        JournalError::IdempotencyConflict => ApiError::idempotency_key_conflict(),
        JournalError::Full => ApiError::journal_unavailable(true),
        JournalError::RecordTooLarge => ApiError::body_too_large(0),
        JournalError::NotFound => ApiError::not_found("response"),
        // R-JRN-6: the store is not open yet (or being opened again): this
        // request alone is refused, and says so; nothing to log per request
        // (the store's state is logged, counted and shown).
        JournalError::Unavailable(state) => ApiError::journal_not_open(state.as_str()),
        // The custody is still ending what an outage cut: logged when it
        // starts and stops, not per request.
        JournalError::Backlog => ApiError::journal_unavailable(false),
        _ => {
            tracing::warn!(event = "edge_journal_error", error = %e);
            ApiError::journal_unavailable(false)
        }
    }
}

/// The error a failed or interrupted record's terminal stands for.
fn terminal_error(terminal: &Terminal) -> ApiError {
    let reason = terminal.reason.as_deref().unwrap_or("");
    match terminal.status {
        RecordStatus::Failed => match failure_of(terminal) {
            Some((kind, provider)) => ApiError::from_gate_failure_with(kind, provider.as_ref()),
            None if reason == "response_too_large" => ApiError::answer_too_large(0),
            None if reason == "journal_unavailable" => ApiError::journal_unavailable(false),
            None => ApiError::internal(),
        },
        RecordStatus::Cancelled => ApiError::response_interrupted("cancelled"),
        RecordStatus::Incomplete => ApiError::response_interrupted(reason),
        RecordStatus::Completed | RecordStatus::InProgress => ApiError::internal(),
    }
}

/// The reason an interrupted record shows: `cancelled`, or its own.
fn interrupted_reason(terminal: &Terminal) -> &str {
    match terminal.status {
        RecordStatus::Cancelled => "cancelled",
        _ => terminal.reason.as_deref().unwrap_or("incomplete"),
    }
}

/// The answer's labels of a stored request.
fn answer_start(run_model: &str, stored: &StoredRequest) -> AnswerStart {
    AnswerStart {
        model: run_model.to_owned(),
        id_seed: stored.id_seed,
        admitted_unix_ms: stored.created_unix_ms,
        committed_unix: stored.created_unix_ms / 1000,
    }
}

/// The conversation a response continues (`previous_response_id`), as
/// the key that asks may see it: every earlier request's own input
/// (without its instructions) and its answer, rebuilt link by link
/// ([`conversation`]).
pub(crate) async fn history(
    state: &AppState,
    key: &ApiKey,
    previous_id: &str,
) -> Result<Vec<ChatMessage>, ApiError> {
    if !client_ids::may_name_stored(JournalApi::Responses, previous_id) {
        return Err(ApiError::previous_response_not_found());
    }
    // R-LIM-6: the walk is one reader of the key's, link after link.
    let _slot = state.reads().begin(key)?;
    conversation(state, &key.principal, previous_id).await
}

/// The conversation up to and including stored response `last_id` of
/// `principal` (R-LIM-6). Each record of a continued conversation keeps
/// its own request and the id of the response it continues, so the
/// conversation is read back by walking those links, newest first, until
/// a response that continues nothing, or one an older build stored with
/// the whole conversation before it ([`StoredRequest::history`]). The
/// walk is bounded: at most [`MAX_CONVERSATION_LINKS`] responses, every
/// stored request read and every answer rebuilt within the principal's
/// share of request memory, held until the conversation is built.
///
/// `last_id` unknown (or another principal's) is a 404, still running a
/// 400; an earlier response no longer stored (it expired, or was deleted:
/// each link expires at its own retention) or unreadable is a 400 that
/// says so, all naming `previous_response_id`.
pub(crate) async fn conversation(
    state: &AppState,
    principal: &str,
    last_id: &str,
) -> Result<Vec<ChatMessage>, ApiError> {
    let store = state.durable().store().clone();
    let mut permits = Vec::new();
    // Each link's own messages and answer, newest first.
    let mut links: Vec<Vec<ChatMessage>> = Vec::new();
    let mut next = Some(last_id.to_owned());
    while let Some(id) = next.take() {
        let first = links.is_empty();
        if links.len() >= MAX_CONVERSATION_LINKS {
            return Err(ApiError::conversation_too_long(MAX_CONVERSATION_LINKS));
        }
        let gone = || {
            if first {
                ApiError::previous_response_not_found()
            } else {
                ApiError::previous_response_unavailable()
            }
        };
        // An id a stored link names was checked when it was stored.
        let (meta, request) = store
            .get(id, iop_transport::clock::unix_ms())
            .await
            .map_err(|e| journal_error(&e))?
            .filter(|(meta, _)| meta.principal == principal && meta.api == JournalApi::Responses)
            .ok_or_else(gone)?;
        if !meta.status().is_terminal() {
            // An earlier link had ended before it was continued.
            return Err(if first {
                ApiError::previous_response_running()
            } else {
                ApiError::previous_response_unavailable()
            });
        }
        permits.push(
            state
                .bodies()
                .hold_stored(principal, &request)
                .map_err(crate::request_body::BodyError::to_api_error)?,
        );
        let stored = StoredRequest::decode(&request).ok_or_else(|| {
            if first {
                ApiError::internal()
            } else {
                ApiError::previous_response_unavailable()
            }
        })?;
        drop(request);
        if stored.history_unreadable {
            return Err(ApiError::previous_response_unreadable());
        }
        let (mut run, options) = Responses
            .parse(&stored.body)
            .map_err(|_| ApiError::internal())?;
        let instructions = Responses
            .instruction_messages(&options)
            .min(run.messages.len());
        let mut link: Vec<ChatMessage> = run.messages.drain(instructions..).collect();
        let mut output = Responses.whole(answer_start(&run.model, &stored), options);
        let mut follower = Follower::open(store.clone(), &meta.id)
            .await
            .map_err(|e| journal_error(&e))?;
        while let Some(Followed::Event(Delivery::Event(event))) =
            follower.next_now().await.map_err(|e| journal_error(&e))?
        {
            output.push(&event);
        }
        let answer = output.assistant_message();
        drop(output);
        if !answer.content.is_empty() || !answer.tool_calls.is_empty() {
            permits.push(
                state
                    .bodies()
                    .hold_answer(principal, message_bytes(&answer))
                    .map_err(crate::request_body::BodyError::to_api_error)?,
            );
            link.push(answer);
        }
        links.push(link);
        match stored.history {
            // An older build stored the conversation before it whole.
            Some(history) => {
                links.push(history);
                break;
            }
            None => next = stored.previous,
        }
    }
    Ok(links.into_iter().rev().flatten().collect())
}

/// The bytes of a message's text and tool calls: what holding it takes,
/// about.
fn message_bytes(message: &ChatMessage) -> usize {
    message.content.len()
        + message
            .tool_calls
            .iter()
            .map(|c| c.id.len() + c.name.len() + c.arguments.len())
            .sum::<usize>()
}

/// What a stored request runs as when a takeover continues its answer or
/// may continue its adopted run (R-TAKE-1, R-CONT-1): its pool now and its
/// work, parsed again from the stored body by its API's endpoint with its
/// conversation put back (read link by link from the store, R-LIM-6).
/// `None` for an API whose answers are not continued (embeddings), a body
/// this build does not parse, or a conversation that cannot be rebuilt.
pub(crate) async fn record_run(
    state: AppState,
    meta: RecordMeta,
    stored: StoredRequest,
) -> Option<(Vec<ProviderId>, Work)> {
    match meta.api {
        JournalApi::ChatCompletions => run_of(&state, ChatCompletions, &meta, stored).await,
        JournalApi::Responses => run_of(&state, Responses, &meta, stored).await,
        JournalApi::Completions => run_of(&state, Completions, &meta, stored).await,
        JournalApi::OllamaChat => run_of(&state, Ollama(RunApi::Chat), &meta, stored).await,
        JournalApi::OllamaGenerate => run_of(&state, Ollama(RunApi::Generate), &meta, stored).await,
        JournalApi::Messages => run_of(&state, Messages, &meta, stored).await,
        JournalApi::Embeddings | JournalApi::OllamaEmbed => None,
    }
}

async fn run_of<E: RunEndpoint>(
    state: &AppState,
    endpoint: E,
    meta: &RecordMeta,
    stored: StoredRequest,
) -> Option<(Vec<ProviderId>, Work)> {
    if stored.history_unreadable {
        // Its conversation cannot be rebuilt: not run again as a part.
        return None;
    }
    let (mut run, options) = endpoint.parse(&stored.body).ok()?;
    let history = match (stored.history, &stored.previous) {
        (Some(history), _) => Some(history),
        (None, Some(previous)) => match conversation(state, &meta.principal, previous).await {
            Ok(history) => Some(history),
            Err(e) => {
                tracing::warn!(
                    event = "edge_response_conversation_unavailable",
                    response = %client_ids::log_tag(&meta.id),
                    code = e.code.unwrap_or("")
                );
                return None;
            }
        },
        (None, None) => None,
    };
    if let Some(history) = history {
        continue_conversation(
            &mut run.messages,
            endpoint.instruction_messages(&options),
            history,
        );
    }
    let pool = crate::admit::pool_for_record(state, &run);
    let work = Work {
        model: state
            .config()
            .model_names
            .provider_model(&run.model)
            .to_owned(),
        api: run.api,
        tools: run.tools,
        params: run.params,
        tunnel: None,
        route: endpoint.route(),
        principal: meta.principal.clone(),
        trace_context: None,
        continuation: iop_core::edge::request::continuation_allowed(
            run.api,
            state.config().continuation_for(&run.model),
        ),
        messages: run.messages,
        // Held when a takeover starts it ([`hold_taken_over`]).
        tenant: None,
        view: None,
    };
    Some((pool, work))
}

/// Charge a takeover's run of record `meta` to the key that asked (the
/// record names it) and its principal, like any request (R-TEN-2): the
/// hold of its admission ended with the Edge that admitted it, so each
/// attempt of its continuation reserves here first, a refused one ends
/// the response with the tenant's error (no provider call), and its usage
/// settles on the key. A key this Edge no longer knows is held to its
/// principal's limits (its usage still lands on its id). `adopted`: the
/// run it adopts is reserved at once with the request's terms, on credit
/// (never refused: its answer was admitted, and the reservation of the
/// Edge that admitted it stays counted), and settles with the usage the
/// run reports at its end.
pub(crate) fn hold_taken_over(state: &AppState, meta: &RecordMeta, work: &mut Work, adopted: bool) {
    // What it sends again (the conversation and the request's input)
    // bounds its prompt, as a body's bytes do.
    let prompt_bytes: usize = work.messages.iter().map(message_bytes).sum();
    let max_output = iop_core::tenant::output_tokens_asked(work.api, work.params.max_tokens);
    let hold = with_record_ask(state, meta, prompt_bytes, max_output, |ask| {
        state.tenancy().admit_taken_over(ask, adopted)
    });
    work.tenant = Some(std::sync::Arc::new(hold));
}

/// Call `f` with what a takeover of record `meta` asks of its tenant
/// (R-TEN-2): the key and principal the record names, with their limits
/// now (a key this Edge no longer knows: none of its own), the record's
/// model and its price, a prompt of at most `prompt_bytes` and
/// `max_output` tokens.
fn with_record_ask<T>(
    state: &AppState,
    meta: &RecordMeta,
    prompt_bytes: usize,
    max_output: Option<u64>,
    f: impl FnOnce(&crate::tenancy::TenantAsk<'_>) -> T,
) -> T {
    let config = state.config();
    let key_limits = state.keys().limits_of(&meta.key_id).unwrap_or_default();
    let principal_limits = config.principal_limits(&meta.principal);
    f(&crate::tenancy::TenantAsk {
        key_id: &meta.key_id,
        key_limits: &key_limits,
        principal: &meta.principal,
        principal_limits: &principal_limits,
        model: &meta.model,
        price: config.price_for(&meta.model),
        body_bytes: prompt_bytes as u64,
        max_output,
        durable: false,
        background: false,
        held: Default::default(),
    })
}

/// Charge the answer of record `meta`, which this Edge's custody ended
/// `incomplete` without running it (R-TEN-2, R-TAKE-1), what its journal
/// holds (`used`, core's `JournaledUse::charged`): to the key and principal
/// the record names, its prompt estimated from above as a takeover's
/// reservation is (the stored request's conversation, `work`; none when it
/// could not be read).
pub(crate) fn charge_ended(
    state: &AppState,
    meta: &RecordMeta,
    used: &iop_core::edge::durable::JournaledUse,
    work: Option<&Work>,
) {
    let prompt_bytes: usize = work.map_or(0, |w| w.messages.iter().map(message_bytes).sum());
    let Some(used) = used.charged(iop_core::tenant::prompt_tokens_max(prompt_bytes as u64)) else {
        return;
    };
    let max_output =
        work.and_then(|w| iop_core::tenant::output_tokens_asked(w.api, w.params.max_tokens));
    with_record_ask(state, meta, prompt_bytes, max_output, |ask| {
        state.tenancy().charge_ended(ask, used);
    });
    tracing::info!(
        event = "edge_response_ended_charged",
        response = %iop_core::edge::client_ids::log_tag(&meta.id),
        input_tokens = used.input,
        output_tokens = used.output
    );
}

/// Put `history` between the request's instructions and its own input.
pub fn continue_conversation(
    messages: &mut Vec<ChatMessage>,
    instructions: usize,
    history: Vec<ChatMessage>,
) {
    let at = instructions.min(messages.len());
    messages.splice(at..at, history);
}

/// Run a durable request: create its record (or find the one its
/// `Idempotency-Key` names), start its run, answer from the journal. A
/// repeated request's stream resumes after `resume_after` (its
/// `Last-Event-ID`), as a reconnecting SSE client asks.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_durable<E: RunEndpoint>(
    state: &AppState,
    endpoint: E,
    admitted: Admitted<E::Options>,
    keep: Keep,
    idempotency: Option<String>,
    resume_after: Option<u64>,
    mut record: RequestRecord,
    view: std::sync::Arc<RequestView>,
) -> Response {
    let Admitted {
        key,
        body,
        body_permit,
        run,
        mut options,
        pool,
        provider_model,
        // Durable runs are never tunnelled.
        renamed_body: _,
        mut tenant,
    } = admitted;
    record.body_permit = Some(body_permit);
    endpoint.mark_kept(&mut options, keep);
    let key_id = key.id.clone();
    let durable = state.durable().clone();
    let created_unix_ms = iop_transport::clock::unix_ms();
    // Ids must be unique across restarts and Edges: random, not counted.
    let id_seed: u64 = rand::random();
    // R-LIM-6: a continued conversation is stored link by link: this
    // request's own body and the response it continues, never the
    // conversation again.
    let stored = StoredRequest {
        id_seed,
        created_unix_ms,
        store: keep.store,
        background: keep.background,
        body: body.to_vec(),
        history: None,
        previous: endpoint.previous_response(&options),
        history_unreadable: false,
    };
    let new = NewRecord {
        id: endpoint.object_id(id_seed),
        principal: key.principal.clone(),
        api: endpoint.journal_api(),
        model: run.model.clone(),
        fingerprint: fingerprint(endpoint.route(), &body),
        idempotency_key: idempotency
            .as_deref()
            .map(|k| idempotency_hash(&key.principal, k)),
        background: keep.background,
        request: stored.encode(),
        created_unix_ms,
        owner: durable.edge_id().to_owned(),
        key_id: key.id.clone(),
    };
    let mut admission = None;
    let (meta, stored, replayed) = match durable.create(new).await {
        Ok(CreateOutcome::Create(meta)) => {
            let (live, cancel) = durable.register(&meta.id);
            if keep.background && !run.stream {
                admission = Some(durable.await_admission(&meta.id));
            }
            view.set_response_id(&meta.id);
            let work = Work {
                model: provider_model,
                api: run.api,
                messages: run.messages,
                tools: run.tools,
                params: run.params,
                tunnel: None,
                route: endpoint.route(),
                principal: key.principal.clone(),
                trace_context: record.span.context(),
                continuation: iop_core::edge::request::continuation_allowed(
                    run.api,
                    state.config().continuation_for(&run.model),
                ),
                // Settled when the run ends, not when the client goes
                // (R-TEN-1: a detached run counts until it ends).
                tenant: tenant.take(),
                view: Some(view),
            };
            driver::spawn_durable(
                state.driver_context().clone(),
                pool,
                work,
                DurableRun {
                    spec: JournalSpec {
                        response_id: meta.id.clone(),
                        epoch: meta.epoch,
                        // Nobody streams a whole answer as it comes.
                        batch_until_terminal: !run.stream,
                    },
                    durable: durable.clone(),
                    commands: cancel,
                    live,
                    park_grace_ms: durable.park_grace_ms(),
                },
            );
            (meta, stored, false)
        }
        Ok(CreateOutcome::Existing(meta)) => {
            // R-IDEM-1: the same request again; nothing runs. Its answer is
            // the stored one's (its own ids and times).
            let found = durable
                .store()
                .get(meta.id.clone(), 0)
                .await
                .ok()
                .flatten()
                .and_then(|(meta, request)| Some((meta, StoredRequest::decode(&request)?)));
            let Some((meta, stored)) = found else {
                return refuse(&endpoint, record, ApiError::internal());
            };
            (meta, stored, true)
        }
        Err(e) => return refuse(&endpoint, record, journal_error(&e)),
    };
    let start = answer_start(&run.model, &stored);
    // A background run that admission refuses (its queue is full) is
    // answered with that error (429, Retry-After), as any request is: the
    // client's retry logic sees it (docs/security.md).
    let refused = match admission {
        Some(admission) => !admission.await.unwrap_or(true),
        None => false,
    };
    let mut response = if keep.background && !run.stream && !refused {
        // Answered once its run is admitted; the client polls or resumes.
        // R-LIM-6: its object is read and built within the key's share,
        // as a retrieve's; the request body's share is given back first.
        drop(body);
        record.body_permit = None;
        let reader = Reader {
            principal: &meta.principal,
            key_id: &key_id,
        };
        match held_responses_object(state, reader, &meta.id).await {
            Ok(held) => {
                record.set("ok");
                held.response(Some(record), state.driver_context().client_write_timeout)
            }
            Err(e) => refuse(&endpoint, record, e),
        }
    } else {
        // Only a repeat has events the client may already hold.
        let skip = resume_after.filter(|_| replayed);
        answer(
            state, &endpoint, &meta.id, start, options, run.stream, skip, record,
        )
        .await
    };
    if replayed {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

fn refuse<E: RunEndpoint>(endpoint: &E, mut record: RequestRecord, err: ApiError) -> Response {
    record.error(&err);
    endpoint.error_response(err)
}

/// Answer a durable request from its journal: wait for its first event
/// (the commit) or its terminal, then stream (`stream`, leaving out the
/// events through `skip_through`) or fold the whole answer.
#[allow(clippy::too_many_arguments)]
async fn answer<E: RunEndpoint>(
    state: &AppState,
    endpoint: &E,
    id: &str,
    start: AnswerStart,
    options: E::Options,
    stream: bool,
    skip_through: Option<u64>,
    record: RequestRecord,
) -> Response {
    let mut follower = match Follower::open(state.durable().store().clone(), id).await {
        Ok(f) => f,
        Err(e) => return refuse(endpoint, record, journal_error(&e)),
    };
    // Before the first event the answer may still be an HTTP error
    // (R-GATE-3): wait for it.
    let first = match follower.next().await {
        Ok(Some(first)) => first,
        Ok(None) => return refuse(endpoint, record, ApiError::internal()),
        Err(e) => return refuse(endpoint, record, journal_error(&e)),
    };
    if let Followed::Ended(terminal) = &first
        && ended_before_commit(terminal, follower.taken())
    {
        return refuse(endpoint, record, terminal_error(terminal));
    }
    if stream {
        E::Stream::response(follow_body(
            state,
            follower,
            Some(first),
            endpoint.stream(start, options),
            skip_through,
            record,
        ))
    } else {
        whole_from_journal(
            follower,
            first,
            endpoint.whole(start, options),
            record,
            endpoint,
        )
        .await
    }
}

/// Fold a durable answer into one object.
async fn whole_from_journal<E: RunEndpoint>(
    mut follower: Follower,
    first: Followed,
    mut whole: E::Whole,
    mut record: RequestRecord,
    endpoint: &E,
) -> Response {
    let mut next = Some(first);
    let mut budget = WholeAnswerBudget::default();
    loop {
        let item = match next.take() {
            Some(item) => item,
            None => match follower.next().await {
                Ok(Some(item)) => item,
                Ok(None) => return refuse(endpoint, record, ApiError::internal()),
                Err(e) => return refuse(endpoint, record, journal_error(&e)),
            },
        };
        match item {
            Followed::Event(Delivery::Event(event)) => {
                if let Err(e) = budget.add(&event) {
                    return refuse(endpoint, record, ApiError::answer_too_large(e.limit_bytes));
                }
                whole.event(&event);
            }
            Followed::Event(_) => {}
            Followed::Ended(terminal) => {
                let answer = match terminal.status {
                    RecordStatus::Completed => whole.answer(iop_transport::clock::unix_ms()),
                    RecordStatus::Incomplete | RecordStatus::Cancelled => {
                        whole.interrupted(interrupted_reason(&terminal))
                    }
                    _ => Err(terminal_error(&terminal)),
                };
                return match answer {
                    Ok(answer) => {
                        record.set("ok");
                        answer.into_response()
                    }
                    Err(e) => refuse(endpoint, record, e),
                };
            }
        }
    }
}

/// A durable answer's steps: the record's events as they become durable,
/// then its terminal (R-JRN-1: a client sees only what is durable).
struct JournalAnswer {
    follower: Follower,
    /// Already read (the commit a new request waited for).
    first: Option<Followed>,
}

impl AnswerSource for JournalAnswer {
    async fn next(&mut self) -> Option<Step> {
        let item = match self.first.take() {
            Some(item) => Ok(Some(item)),
            None => self.follower.next().await,
        };
        match item {
            Ok(item) => item.map(journal_step),
            Err(e) => Some(Step::Failed(journal_error(&e))),
        }
    }

    fn ready(&mut self) -> Option<Step> {
        self.follower.ready().map(journal_step)
    }
}

/// What a journal item says to the answer's body.
fn journal_step(item: Followed) -> Step {
    match item {
        Followed::Event(Delivery::Event(event)) => Step::Event(event),
        // Only run events are journal events.
        Followed::Event(_) => Step::Nothing,
        Followed::Ended(terminal) => match terminal.status {
            RecordStatus::Completed => Step::Completed,
            RecordStatus::Incomplete | RecordStatus::Cancelled => Step::Interrupted {
                reason: interrupted_reason(&terminal).to_owned(),
                err: terminal_error(&terminal),
            },
            _ => Step::Failed(terminal_error(&terminal)),
        },
    }
}

/// The body of a durable stream: the encoder's opening frames, then the
/// record's events as they become durable, then its terminal; SSE events
/// numbered, those up to `skip_through` left out.
fn follow_body<S: AnswerStream>(
    state: &AppState,
    follower: Follower,
    first: Option<Followed>,
    encoder: S,
    skip_through: Option<u64>,
    record: RequestRecord,
) -> BoxStream<'static, Bytes> {
    let numbering = S::SSE_IDS.then(|| framing::SseNumbering::after(skip_through));
    // R-LIM-6: a reader that stops reading lets its follower go.
    crate::answer_body::with_write_timeout(
        answer_body(
            JournalAnswer { follower, first },
            encoder,
            numbering,
            state.driver_context().sse_keep_alive,
            record,
        ),
        state.driver_context().client_write_timeout,
    )
}

/// A stored record the caller may read: its metadata, its stored request,
/// the caller's share of the read memory and its place among the readers
/// in flight (R-LIM-6), held while what was read is in use.
struct Readable {
    meta: RecordMeta,
    stored: StoredRequest,
    _permit: crate::request_body::BodyPermit,
    _slot: crate::store_reads::ReadSlot,
}

/// Who reads: a principal's key (R-LIM-6: reads in flight are bounded
/// per principal and per key).
#[derive(Clone, Copy)]
struct Reader<'a> {
    principal: &'a str,
    key_id: &'a str,
}

impl<'a> From<&'a ApiKey> for Reader<'a> {
    fn from(key: &'a ApiKey) -> Self {
        Reader {
            principal: &key.principal,
            key_id: &key.id,
        }
    }
}

async fn readable(
    state: &AppState,
    reader: Reader<'_>,
    id: &str,
    api: JournalApi,
) -> Result<Readable, ApiError> {
    // R-LIM-5: an id the Edge cannot have issued names nothing; it goes to
    // no store, subject or log.
    if !client_ids::may_name_stored(api, id) {
        return Err(ApiError::not_found("response"));
    }
    // R-LIM-6: a place among the readers in flight before any store read.
    let slot = state.reads().begin_as(reader.principal, reader.key_id)?;
    let found = state
        .durable()
        .store()
        .get(id.to_owned(), iop_transport::clock::unix_ms())
        .await
        .map_err(|e| journal_error(&e))?;
    // Another key's response is indistinguishable from none.
    let (meta, request) = found
        .filter(|(meta, _)| meta.principal == reader.principal && meta.api == api)
        .ok_or_else(|| ApiError::not_found("response"))?;
    // R-LIM-6: counted against the caller's principal like a body.
    let permit = state
        .bodies()
        .hold_stored(reader.principal, &request)
        .map_err(crate::request_body::BodyError::to_api_error)?;
    let stored = StoredRequest::decode(&request).ok_or_else(ApiError::internal)?;
    Ok(Readable {
        meta,
        stored,
        _permit: permit,
        _slot: slot,
    })
}

/// The parsed run and options of a stored request, marked as kept.
fn reparse<E: RunEndpoint>(
    endpoint: &E,
    stored: &StoredRequest,
) -> Result<(crate::api::NormalizedRun, E::Options), ApiError> {
    let (run, mut options) = endpoint
        .parse(&stored.body)
        .map_err(|_| ApiError::internal())?;
    endpoint.mark_kept(
        &mut options,
        Keep {
            store: stored.store,
            background: stored.background,
        },
    );
    Ok((run, options))
}

/// The `response` object of a stored response as it is now, from its
/// record read and parsed once (R-LIM-6).
async fn responses_object_of(
    state: &AppState,
    meta: &RecordMeta,
    stored: &StoredRequest,
    model: &str,
    options: <Responses as RunEndpoint>::Options,
) -> Result<Value, ApiError> {
    let id = meta.id.as_str();
    let store = state.durable().store().clone();
    let mut acc = Responses.whole(answer_start(model, stored), options);
    let mut follower = Follower::open(store, id)
        .await
        .map_err(|e| journal_error(&e))?;
    loop {
        match follower.next_now().await.map_err(|e| journal_error(&e))? {
            Some(Followed::Event(Delivery::Event(event))) => acc.push(&event),
            Some(Followed::Event(_)) => {}
            Some(Followed::Ended(terminal)) => {
                return Ok(match terminal.status {
                    RecordStatus::Completed => match acc.finish() {
                        Ok(v) => v,
                        Err(e) => acc.failed_snapshot(&e),
                    },
                    RecordStatus::Failed => acc.failed_snapshot(&terminal_error(&terminal)),
                    _ => acc.interrupted_snapshot(interrupted_reason(&terminal)),
                });
            }
            None => {
                let status = if meta.background && follower.taken() == 0 {
                    "queued"
                } else {
                    "in_progress"
                };
                return Ok(acc.snapshot(status, Value::Null, Value::Null));
            }
        }
    }
}

/// Query of a stored object's `GET`.
#[derive(Debug, Deserialize, Default)]
pub struct RetrieveQuery {
    /// Stream the response: replay, then follow.
    #[serde(default)]
    stream: Option<bool>,
    /// Leave out the stream's events up to this `sequence_number` / SSE id.
    #[serde(default)]
    starting_after: Option<u64>,
}

/// The query string as `T`; a malformed one is a 400 naming it.
fn query_of<T: serde::de::DeserializeOwned + Default>(uri: &Uri) -> Result<T, ApiError> {
    if uri.query().is_none_or(str::is_empty) {
        return Ok(T::default());
    }
    Query::<T>::try_from_uri(uri).map(|q| q.0).map_err(|_| {
        ApiError::invalid_value("query", "is not a valid query string for this route.")
    })
}

/// The resume point: `starting_after`, else `Last-Event-ID`.
fn resume_point(query: &RetrieveQuery, headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    if query.starting_after.is_some() {
        return Ok(query.starting_after);
    }
    last_event_id(headers)
}

/// The `Last-Event-ID` header, if sent: the last SSE event id a
/// reconnecting client holds.
pub(crate) fn last_event_id(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    match headers.get("last-event-id") {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .map(Some)
            .ok_or_else(|| ApiError::invalid_value("Last-Event-ID", "must be an event id.")),
    }
}

/// `GET /v1/responses/{id}`.
pub async fn retrieve_response(
    State(state): State<AppState>,
    Path(id): Path<String>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    match query_of(&uri) {
        Ok(query) => retrieve(&state, Responses, &id, &query, &headers).await,
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/chat/completions/{id}`: a stored completion, or with
/// `?stream=true` its stream resumed (an iop extension).
pub async fn retrieve_chat_completion(
    State(state): State<AppState>,
    Path(id): Path<String>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    match query_of(&uri) {
        Ok(query) => retrieve(&state, ChatCompletions, &id, &query, &headers).await,
        Err(e) => e.into_response(),
    }
}

/// An API whose stored answers are retrieved whole as an object.
trait Retrievable: RunEndpoint {
    /// The object of stored record `meta` as it is now, from its request
    /// read and parsed once (R-LIM-6).
    fn object<'a>(
        &'a self,
        state: &'a AppState,
        meta: &'a RecordMeta,
        stored: &'a StoredRequest,
        start: AnswerStart,
        options: Self::Options,
    ) -> impl std::future::Future<Output = Result<Value, ApiError>> + Send + 'a;
}

impl Retrievable for Responses {
    async fn object<'a>(
        &'a self,
        state: &'a AppState,
        meta: &'a RecordMeta,
        stored: &'a StoredRequest,
        start: AnswerStart,
        options: Self::Options,
    ) -> Result<Value, ApiError> {
        responses_object_of(state, meta, stored, &start.model, options).await
    }
}

impl Retrievable for ChatCompletions {
    fn object<'a>(
        &'a self,
        state: &'a AppState,
        meta: &'a RecordMeta,
        _stored: &'a StoredRequest,
        start: AnswerStart,
        _options: Self::Options,
    ) -> impl std::future::Future<Output = Result<Value, ApiError>> + Send + 'a {
        chat_object(state, &meta.id, start)
    }
}

/// Bytes of a retrieved object handed to the connection at a time: the
/// body is held (and charged) until its last piece is taken.
const RETRIEVED_CHUNK_BYTES: usize = 64 * 1024;

async fn retrieve<E: Retrievable>(
    state: &AppState,
    endpoint: E,
    id: &str,
    query: &RetrieveQuery,
    headers: &HeaderMap,
) -> Response {
    let record = RequestRecord::new(state, "retrieve", headers);
    let found = async {
        let key = authenticate(state, headers)?;
        let skip = resume_point(query, headers)?;
        let read = readable(state, Reader::from(&*key), id, endpoint.journal_api()).await?;
        Ok::<_, ApiError>((key, read, skip))
    }
    .await;
    let (key, read, skip) = match found {
        Ok(found) => found,
        Err(e) => return refuse(&endpoint, record, e),
    };
    let (meta, stored) = (&read.meta, &read.stored);
    // R-LIM-6: the stored request is parsed once per read.
    let (run, options) = match reparse(&endpoint, stored) {
        Ok(parsed) => parsed,
        Err(e) => return refuse(&endpoint, record, e),
    };
    let start = answer_start(&run.model, stored);
    drop(run);
    if query.stream == Some(true) {
        let follower = match Follower::open(state.durable().store().clone(), &meta.id).await {
            Ok(f) => f,
            Err(e) => return refuse(&endpoint, record, journal_error(&e)),
        };
        return E::Stream::response(follow_body(
            state,
            follower,
            None,
            endpoint.stream(start, options),
            skip,
            record,
        ));
    }
    match held_object(state, &endpoint, &key.principal, read, start, options).await {
        Ok(held) => {
            let mut record = record;
            record.set("ok");
            held.response(Some(record), state.driver_context().client_write_timeout)
        }
        Err(e) => refuse(&endpoint, record, e),
    }
}

/// A stored object rendered as JSON, its bytes charged to its reader's
/// share until they have been sent (R-LIM-6).
struct HeldObject {
    body: Bytes,
    permit: crate::request_body::BodyPermit,
}

impl HeldObject {
    /// The JSON answer ([`held_json`]).
    fn response(
        self,
        record: Option<RequestRecord>,
        write_timeout: std::time::Duration,
    ) -> Response {
        held_json(self.body, self.permit, record, write_timeout)
    }
}

/// The object of record `read` as it is now, built within `principal`'s
/// share (R-LIM-6): charged before it is built at its bound (from the
/// record's event bytes), then at what its body takes. Every answer that
/// renders a stored object is built here: a retrieve, a cancel's object,
/// a background response's first object.
async fn held_object<E: Retrievable>(
    state: &AppState,
    endpoint: &E,
    principal: &str,
    read: Readable,
    start: AnswerStart,
    options: E::Options,
) -> Result<HeldObject, ApiError> {
    let bodies = state.bodies();
    let event_bytes = read
        .meta
        .stored_bytes
        .saturating_sub(read.stored.body.len() as u64);
    let mut permit = bodies
        .hold_answer(
            principal,
            iop_core::edge::whole_answer::rendering_bytes(event_bytes),
        )
        .map_err(crate::request_body::BodyError::to_api_error)?;
    let object = endpoint
        .object(state, &read.meta, &read.stored, start, options)
        .await?;
    // The stored request is no longer needed, nor its place among the
    // readers.
    drop(read);
    let body = Bytes::from(serde_json::to_vec(&object).map_err(|_| ApiError::internal())?);
    drop(object);
    bodies
        .refit(principal, &mut permit, body.len())
        .map_err(crate::request_body::BodyError::to_api_error)?;
    Ok(HeldObject { body, permit })
}

/// The `response` object of stored response `id` as it is now, read by
/// `reader` and held to its share ([`held_object`]).
async fn held_responses_object(
    state: &AppState,
    reader: Reader<'_>,
    id: &str,
) -> Result<HeldObject, ApiError> {
    let read = readable(state, reader, id, JournalApi::Responses).await?;
    let (run, options) = reparse(&Responses, &read.stored)?;
    let start = answer_start(&run.model, &read.stored);
    drop(run);
    held_object(state, &Responses, reader.principal, read, start, options).await
}

/// A JSON answer whose bytes stay charged to `permit` until the
/// connection has taken the last of them; a reader that takes none within
/// `write_timeout` is cut off and its share given back (R-LIM-6).
fn held_json(
    body: Bytes,
    permit: crate::request_body::BodyPermit,
    record: Option<RequestRecord>,
    write_timeout: std::time::Duration,
) -> Response {
    use futures::StreamExt as _;
    let len = body.len();
    let pieces: Vec<Bytes> = (0..len)
        .step_by(RETRIEVED_CHUNK_BYTES)
        .map(|at| body.slice(at..(at + RETRIEVED_CHUNK_BYTES).min(len)))
        .collect();
    drop(body);
    let held = (permit, record);
    let stream = futures::stream::iter(pieces)
        .chain(futures::stream::poll_fn(move |_| {
            // The last piece has been taken: the share goes back.
            let _ = &held;
            std::task::Poll::Ready(None)
        }))
        .boxed();
    let stream = crate::answer_body::with_write_timeout(stream, write_timeout)
        .map(Ok::<_, std::convert::Infallible>);
    let mut response = axum::body::Body::from_stream(stream).into_response();
    let headers = response.headers_mut();
    headers.insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(axum::http::header::CONTENT_LENGTH, HeaderValue::from(len));
    response
}

/// A stored `chat.completion` as it is now.
async fn chat_object(state: &AppState, id: &str, start: AnswerStart) -> Result<Value, ApiError> {
    let mut acc = crate::api::chat::ChatAccumulator::new(
        ids::chat_completion_id(start.id_seed),
        start.model,
        start.committed_unix,
    );
    let mut follower = Follower::open(state.durable().store().clone(), id)
        .await
        .map_err(|e| journal_error(&e))?;
    while let Some(item) = follower.next_now().await.map_err(|e| journal_error(&e))? {
        match item {
            Followed::Event(Delivery::Event(event)) => acc.push(&event),
            Followed::Event(_) => {}
            Followed::Ended(terminal) if terminal.status == RecordStatus::Failed => {
                return Err(terminal_error(&terminal));
            }
            Followed::Ended(_) => break,
        }
    }
    acc.snapshot()
}

/// `POST /v1/responses/{id}/cancel`: cancel a running response; the
/// response object (`cancelled`, or as it ended if it had already).
pub async fn cancel_response(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let answer = async {
        let key = authenticate(&state, &headers)?;
        let meta = readable(&state, Reader::from(&*key), &id, JournalApi::Responses)
            .await?
            .meta;
        if !meta.status().is_terminal() {
            cancel_and_wait(&state, &meta).await?;
        }
        // R-LIM-6: the object is read again (it has its terminal now) and
        // built within the key's share, as a retrieve's.
        held_responses_object(&state, Reader::from(&*key), &id).await
    }
    .await;
    match answer {
        Ok(held) => held.response(None, state.driver_context().client_write_timeout),
        Err(e) => e.into_response(),
    }
}

/// How long a cancel waits for the run's terminal to be written.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Cancel a running record and wait (bounded) for its terminal. A run this
/// Edge writes is cancelled through its driver; a record no live run
/// writes (its Edge is gone) is taken over and ended `cancelled` here
/// (R-JRN-3: raising the epoch fences whatever still writes it).
async fn cancel_and_wait(state: &AppState, meta: &RecordMeta) -> Result<(), ApiError> {
    let durable = state.durable();
    let store = durable.store().clone();
    if durable.cancel(&meta.id) {
        let mut progress = store
            .watch(meta.id.clone())
            .await
            .map_err(|e| journal_error(&e))?;
        let ended = tokio::time::timeout(CANCEL_WAIT, progress.wait_for(|p| p.ended)).await;
        if ended.is_err() {
            tracing::warn!(event = "edge_response_cancel_slow", response = %iop_core::edge::client_ids::log_tag(&meta.id));
        }
        return Ok(());
    }
    match durable
        .end_as(meta, RecordStatus::Cancelled, "cancelled")
        .await
    {
        Ok(()) | Err(JournalError::Terminated | JournalError::Fenced { .. }) => Ok(()),
        Err(e) => Err(journal_error(&e)),
    }
}

async fn delete_stored(
    state: &AppState,
    headers: &HeaderMap,
    id: &str,
    api: JournalApi,
    object: &str,
) -> Response {
    let answer = async {
        let key = authenticate(state, headers)?;
        let meta = readable(state, Reader::from(&*key), id, api).await?.meta;
        if !meta.status().is_terminal() {
            cancel_and_wait(state, &meta).await?;
        }
        match state.durable().store().delete(id.to_owned()).await {
            Ok(()) | Err(JournalError::NotFound) => {}
            Err(e) => return Err(journal_error(&e)),
        }
        Ok(json!({ "id": id, "object": object, "deleted": true }))
    }
    .await;
    match answer {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete_response(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    delete_stored(&state, &headers, &id, JournalApi::Responses, "response").await
}

/// `DELETE /v1/chat/completions/{id}`.
pub async fn delete_chat_completion(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    delete_stored(
        &state,
        &headers,
        &id,
        JournalApi::ChatCompletions,
        "chat.completion.deleted",
    )
    .await
}

/// Query of `GET /v1/responses/{id}/input_items`.
#[derive(Debug, Deserialize, Default)]
pub struct InputItemsQuery {
    #[serde(default)]
    order: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    after: Option<String>,
}

/// `GET /v1/responses/{id}/input_items`: the request's input items, each
/// with an id, as a list (`order` `desc` by default, `limit` 1..=100,
/// default 20, `after` an item id).
pub async fn input_items(
    State(state): State<AppState>,
    Path(id): Path<String>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let answer = async {
        let query: InputItemsQuery = query_of(&uri)?;
        let key = authenticate(&state, &headers)?;
        let read = readable(&state, Reader::from(&*key), &id, JournalApi::Responses).await?;
        let stored = &read.stored;
        let limit = query.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(ApiError::invalid_value(
                "limit",
                "must be between 1 and 100.",
            ));
        }
        let descending = match query.order.as_deref() {
            None | Some("desc") => true,
            Some("asc") => false,
            Some(_) => return Err(ApiError::invalid_value("order", "must be 'asc' or 'desc'.")),
        };
        let mut items = crate::api::responses::input_items(&stored.body, &id)
            .map_err(|_| ApiError::internal())?;
        if descending {
            items.reverse();
        }
        if let Some(after) = &query.after {
            match items.iter().position(|item| item["id"] == after.as_str()) {
                Some(i) => {
                    items.drain(..=i);
                }
                None => {
                    return Err(ApiError::invalid_value(
                        "after",
                        "is not an item of this response.",
                    ));
                }
            }
        }
        let has_more = items.len() > limit;
        items.truncate(limit);
        Ok(json!({
            "object": "list",
            "first_id": items.first().map(|i| i["id"].clone()),
            "last_id": items.last().map(|i| i["id"].clone()),
            "has_more": has_more,
            "data": items,
        }))
    }
    .await;
    match answer {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
