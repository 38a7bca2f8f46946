//! Parked runs nodes report (R-PARK-2), carried to the run of this Edge
//! that waits for one, or taken over (R-TAKE-1): the record's epoch is won
//! first (R-JRN-3) and a driver adopts the run after the frame the core's
//! [`iop_core::edge::durable::takeover_resume_point`] names. Between the
//! durable store ([`crate::durable`]) and the request drivers
//! ([`crate::driver`]), which neither depends on the other for it.

use std::sync::Arc;

use iop_core::edge::dispatch::ParkedOffer;
use tokio::sync::mpsc;

use crate::driver::{DriverContext, DurableRun, Takeover, Work, spawn_takeover};
use crate::durable::{Durable, LiveCommand};

/// Carry the parked runs nodes report (R-PARK-2) to the runs that wait
/// for them, or take their records over (R-TAKE-1), for as long as the
/// Edge runs. A run nobody takes has its held capacity let go.
pub fn spawn_adoptions(
    durable: &Arc<Durable>,
    mut parked: mpsc::UnboundedReceiver<Vec<ParkedOffer>>,
    ctx: DriverContext,
) -> tokio::task::JoinHandle<()> {
    let durable = durable.clone();
    tokio::spawn(async move {
        while let Some(runs) = parked.recv().await {
            for offer in runs {
                let key = offer.run.key;
                if let Err(why) = offer_run(&durable, &ctx, offer).await {
                    tracing::info!(event = "edge_parked_run_not_adopted", reason = why);
                    ctx.hub.release_parked(key);
                }
            }
        }
    })
}

/// Offer one parked run: to the run of this Edge that waits for it, or
/// take its record over.
async fn offer_run(
    durable: &Arc<Durable>,
    ctx: &DriverContext,
    offer: ParkedOffer,
) -> Result<(), &'static str> {
    let live = durable.live().get(&offer.run.response_id).cloned();
    if let Some(tx) = live {
        // Its driver adopts it, or lets it go if it no longer waits.
        return tx
            .send(LiveCommand::Parked(offer))
            .await
            .map_err(|_| "run_gone");
    }
    let id = offer.run.response_id.clone();
    let (meta, _) = durable
        .store()
        .get(id.clone(), 0)
        .await
        .map_err(|_| "store_error")?
        .ok_or("unknown_response")?;
    // R-PARK-2, R-TAKE-1: the core decides whether this record is the
    // reported run's, and after which frame it resumes.
    durable.resume_point(&meta, &offer).await?;
    // R-JRN-3: win the record's epoch before writing anything; a lost
    // race means another writer has it.
    let started = std::time::Instant::now();
    let raised = durable
        .store()
        .raise_epoch(id.clone(), meta.epoch, durable.edge_id().to_owned())
        .await;
    durable.observe("raise_epoch", started, &raised);
    let raised = raised.map_err(|_| "epoch_lost")?;
    // The resume point is read again now that nothing else can write:
    // the former writer may have appended after the first read and
    // before the raise (its epoch was still current then).
    let resume_after_frame = durable.resume_point(&raised, &offer).await?;
    let meta = raised;
    tracing::info!(
        event = "edge_response_taken_over",
        response = %id,
        epoch = meta.epoch,
        resume_after_frame
    );
    let work = Work {
        model: meta.model.clone(),
        api: iop_wire::RunApi::Chat,
        messages: Vec::new(),
        tools: Vec::new(),
        params: iop_wire::GenerationParams::default(),
        tunnel: None,
        route: meta.api.as_str(),
        principal: meta.principal.clone(),
        trace_context: None,
        // An adopted run is not continued elsewhere after a restart.
        continuation: false,
    };
    let (live, commands) = durable.register(&id);
    spawn_takeover(
        ctx.clone(),
        work,
        DurableRun {
            spec: iop_core::edge::durable::JournalSpec {
                response_id: id,
                epoch: meta.epoch,
                batch_until_terminal: false,
            },
            durable: durable.clone(),
            commands,
            live,
            park_grace_ms: durable.park_grace_ms(),
        },
        Takeover {
            offer,
            last_seq: meta.last_seq,
            resume_after_frame,
        },
    );
    Ok(())
}
