package bus

// Approval signals (docs/grants.md "Approvals"): a request outside an
// agent's policy waits for an operator. Both are scoped like audit signals
// (addressed to subscribers who may view the agent, never broadcast): they
// carry what the agent asked for.
const (
	SignalApprovalPending = "ApprovalPending" // (s agent, s id, s host, u port, s method, s path, x since_unix, x expires_unix)
	SignalApprovalDecided = "ApprovalDecided" // (s agent, s id, s verdict, s by)
)
