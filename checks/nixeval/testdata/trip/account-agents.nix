# want: services.nixcage.accounts."ops".agents names ghost, not declared in services.nixcage.agents
{
  services.nixcage.agents.a = { backend = "service"; command = [ "/bin/true" ]; };
  services.nixcage.accounts.ops = { group = "wheel"; role = "operator"; agents = [ "a" "ghost" ]; };
}
