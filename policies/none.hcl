# No egress at all: every request and every DNS query is refused and audited.
# Agents that name no policy get this one.
egress_policy "none" {
  allow = []
}
