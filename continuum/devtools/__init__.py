"""Developer tools shipped with the router: the demo and the fleet of child processes it runs."""
