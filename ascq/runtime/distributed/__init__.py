"""Process groups and parallel state (tensor / pipeline / expert parallel), rendezvous and process
watching."""
