//! Worker names, identities and call destinations.

use serde::{Deserialize, Serialize};

/// Longest worker name accepted.
pub const MAX_NAME_LEN: usize = 128;

/// Why a worker name was refused: one variant per rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("a worker name must not be empty")]
    Empty,
    #[error("worker name `{name}` is {len} characters long; the limit is {MAX_NAME_LEN}")]
    TooLong { name: String, len: usize },
    #[error("worker name `{name}` contains {character:?}; only letters, digits, `_`, `-` and `:` are allowed")]
    BadCharacter { name: String, character: char },
}

/// Checks a worker name: non-empty, at most [`MAX_NAME_LEN`] characters, only ASCII letters,
/// digits, `_`, `-` and `:`.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    let len = name.chars().count();
    if len > MAX_NAME_LEN {
        return Err(NameError::TooLong {
            name: name.chars().take(32).collect::<String>() + "…",
            len,
        });
    }
    if let Some(character) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | ':')))
    {
        return Err(NameError::BadCharacter {
            name: name.to_owned(),
            character,
        });
    }
    Ok(())
}

/// A worker of the group: its name and its id. The id is the rank for a fixed group's first
/// start; joins and restarts get fresh ids from the store (ids are never reused).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub name: String,
    pub id: u32,
}

impl std::fmt::Display for WorkerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (id {})", self.name, self.id)
    }
}

/// Where a call goes: a worker name, a rank, or a [`WorkerInfo`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dest {
    Name(String),
    Rank(u32),
}

impl std::fmt::Display for Dest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dest::Name(n) => write!(f, "`{n}`"),
            Dest::Rank(r) => write!(f, "rank {r}"),
        }
    }
}

impl From<&str> for Dest {
    fn from(s: &str) -> Self {
        Dest::Name(s.to_owned())
    }
}

impl From<String> for Dest {
    fn from(s: String) -> Self {
        Dest::Name(s)
    }
}

impl From<&String> for Dest {
    fn from(s: &String) -> Self {
        Dest::Name(s.clone())
    }
}

impl From<u32> for Dest {
    fn from(r: u32) -> Self {
        Dest::Rank(r)
    }
}

impl From<&WorkerInfo> for Dest {
    fn from(w: &WorkerInfo) -> Self {
        Dest::Rank(w.id)
    }
}

impl From<WorkerInfo> for Dest {
    fn from(w: WorkerInfo) -> Self {
        Dest::Rank(w.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(validate_name("trainer-3").is_ok());
        assert!(validate_name("ps:0_a").is_ok());
        assert_eq!(validate_name(""), Err(NameError::Empty));
        assert!(matches!(
            validate_name(&"a".repeat(129)),
            Err(NameError::TooLong { len: 129, .. })
        ));
        assert!(validate_name(&"a".repeat(128)).is_ok());
        assert!(matches!(
            validate_name("a b"),
            Err(NameError::BadCharacter { character: ' ', .. })
        ));
        assert!(matches!(
            validate_name("wörker"),
            Err(NameError::BadCharacter { character: 'ö', .. })
        ));
    }
}
