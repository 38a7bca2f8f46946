//! Identifiers the core keys its state by.

use std::fmt;

macro_rules! string_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
        pub struct $name(pub String);

        impl $name {
            /// Wrap a string.
            pub fn new(s: impl Into<String>) -> Self {
                Self(s.into())
            }
            /// The string form.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_owned())
            }
        }
    };
}

string_id! {
    /// A node's identity, taken from its certificate (never from a message).
    NodeId
}

string_id! {
    /// A provider's stable id from the Edge configuration.
    ProviderId
}

/// A run or tunnel id, unique per Edge process.
pub type RunId = u64;

/// A connection generation (R-GEN-1).
pub type Generation = u64;
