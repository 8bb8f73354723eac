//! Admin HTTP API (placeholder).
