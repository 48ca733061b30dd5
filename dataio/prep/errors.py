"""Why an input produced nothing; `reason` is the value of failures.parquet's reason column."""


class PrepError(Exception):
    # reasons: empty_file, unreadable, invalid_data, no_video_stream, unsupported_codec,
    # no_duration, decode_error, truncated, no_clips, not_an_image, error
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
