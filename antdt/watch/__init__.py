"""What a person or an operator watches of running jobs, through Dask's own web server."""
