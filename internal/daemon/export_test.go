package daemon

// MaxRefusedFeedAcks is maxRefusedFeedAcks for the external tests.
const MaxRefusedFeedAcks = maxRefusedFeedAcks
