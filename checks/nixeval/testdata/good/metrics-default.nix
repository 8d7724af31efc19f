# metrics = { } turns metrics on at the Go schema's default address: the
# empty block must reach the model (as a one-block list), not be dropped.
{
  services.nixcage = {
    enable = true;
    agents.a.command = [ "/bin/true" ];
    metrics = { };
  };
}
