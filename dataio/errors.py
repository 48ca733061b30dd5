"""Why an input yields nothing. One exception for every skip in dataio: `reason` is the skip
counter a reader adds it to, or the `reason` column of prep's failures.parquet (empty_file,
unreadable, invalid_data, no_video_stream, unsupported_codec, no_duration, decode_error,
truncated, no_clips, not_an_image, error, ...); `detail` says what exactly."""


class MediaError(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
