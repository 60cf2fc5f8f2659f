pub mod placeholder {}
