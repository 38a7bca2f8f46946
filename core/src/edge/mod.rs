//! Edge-side rules: generations, admission and leases, the health overlay,
//! the stream gate, the provider health tracker, one node connection
//! ([`link::EdgeLink`]), the limits on client connections and request
//! bodies ([`limits`]), and the shape of the identifiers clients send back
//! ([`client_ids`]).

pub mod admission;
pub mod client_ids;
pub mod custody;
pub mod delivery;
pub mod dispatch;
pub mod durable;
pub mod flood;
pub mod gate;
pub mod generations;
pub mod health;
pub mod limits;
pub mod link;
pub mod overlay;
pub mod prompt_estimate;
pub mod registry;
pub mod request;
pub mod store_reads;
pub mod tunnel_meter;
pub mod whole_answer;
